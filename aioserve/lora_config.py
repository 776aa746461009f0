"""LoRA serving's settings, from the flags vLLM and SGLang users type.

vLLM: `--enable-lora --lora-modules name=path ...` (or its JSON form
`'{"name": ..., "path": ..., "base_model_name": ...}'`), `--max-loras`,
`--max-lora-rank`, `--max-cpu-loras`. SGLang: `--lora-paths name=path ...`
(or a bare path, named by itself), `--max-loras-per-batch`. Both resolve to
one `LoraConfig`; like speculative_config.py it imports only config.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aioserve.config import LORA_DTYPES, ConfigError, EngineConfig


@dataclass(frozen=True)
class AdapterSource:
    """An adapter named at start: the name requests give as their `model`, its PEFT folder."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoraConfig:
    max_loras: int  # slots: adapters one step can use
    max_lora_rank: int  # the slots' rank
    max_cpu_loras: int | None  # adapters kept read in host memory (None: all)
    adapters: tuple[AdapterSource, ...]  # loaded at start
    dtype: str | None = None  # --lora-dtype's torch dtype name: the adapters' weights rounded to it (None: the model's)


def parse_adapter_source(text: str) -> AdapterSource:
    """One --lora-modules / --lora-paths value: NAME=PATH, a JSON object, or a bare PATH."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lora-modules: not JSON: {exc}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ConfigError(f"--lora-modules: a JSON adapter needs string fields name and path, got {text}")
        base = spec.get("base_model_name")
        return AdapterSource(spec["name"], spec["path"], base if isinstance(base, str) else None)
    name, sep, path = text.partition("=")
    if not sep:
        return AdapterSource(text, text)
    if not name or not path:
        raise ConfigError(f"--lora-modules: {text!r} is not NAME=PATH")
    return AdapterSource(name, path)


def resolve_lora(config: EngineConfig) -> LoraConfig | None:
    """The LoRA settings, or None when adapters are not served. Naming
    adapters implies --enable-lora (SGLang's --lora-paths does)."""
    if not config.enable_lora and not config.lora_modules:
        return None
    if config.runner == "pooling" or config.pooler_config is not None:
        raise ConfigError("LoRA adapters are served on generating models only, not with --runner pooling")
    adapters = tuple(parse_adapter_source(text) for text in config.lora_modules or [])
    names = [adapter.name for adapter in adapters]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ConfigError(f"--lora-modules names {', '.join(doubled)} more than once")
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ConfigError(
            f"--max-cpu-loras ({config.max_cpu_loras}) must be at least --max-loras ({config.max_loras}): "
            "an adapter in a slot is also held in host memory"
        )
    if config.lora_dtype not in LORA_DTYPES:
        raise ConfigError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got {config.lora_dtype!r}")
    dtype = None if config.lora_dtype == "auto" else config.lora_dtype
    return LoraConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras, adapters, dtype)


class AdapterError(ValueError):
    """An adapter that cannot be served: a malformed folder, a feature not
    served (DoRA, modules_to_save, embeddings), a rank over --max-lora-rank,
    a base model it does not fit. The message says which."""
