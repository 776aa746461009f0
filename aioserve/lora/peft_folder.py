"""A PEFT LoRA adapter as people save it: `adapter_config.json` and
`adapter_model.safetensors` with PEFT's tensor names
(`base_model.model.<module>.lora_A.weight` [r, in], `.lora_B.weight` [out, r]).

Read and checked here, knowing nothing of the model: what is refused is
refused with the reason (DoRA, `modules_to_save`, a bias, adapted embeddings,
a rank past the slots', pickled weights). The scale alpha / r (alpha /
sqrt(r) with rsLoRA) is worked out per module, `rank_pattern` and
`alpha_pattern` included.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aioserve.lora_config import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# <module>.lora_A.weight, or with the adapter's name (<module>.lora_A.default.weight).
_LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class ModuleAdapter:
    """One adapted linear layer, as the checkpoint names it (`model.layers.0.self_attn.q_proj`)."""

    name: str
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float  # alpha / r, or alpha / sqrt(r) with rsLoRA

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class PeftAdapter:
    path: Path
    rank: int  # the config's r (a module's may differ by rank_pattern)
    base_model: str | None  # base_model_name_or_path, as the adapter was trained on
    modules: list[ModuleAdapter]


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module whose name
    ends with it (as a dotted suffix) or matches it as a regular expression."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _check_config(config: dict[str, Any], where: Path) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{where}: a {peft_type} adapter; only LoRA adapters are served")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: a DoRA adapter (use_dora); DoRA's magnitude vectors are not served")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{where}: the adapter saves whole modules (modules_to_save: {', '.join(map(str, config['modules_to_save']))}); "
            "only low-rank updates of the linear layers are served, not replaced embeddings or heads"
        )
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {config['bias']!r}; only adapters trained with bias 'none' are served")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: fan_in_fan_out (GPT-2's Conv1D layout) is not served")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterError(f"{where}: {key} must be a positive number, got {value!r}")


def read_peft_adapter(path: str | Path, max_rank: int) -> PeftAdapter:
    folder = Path(path)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"{folder}: no {CONFIG_FILE} (a LoRA adapter is a PEFT folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_file}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file}: not a JSON object")
    _check_config(config, folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = " (adapter_model.bin is pickled: save with safe_serialization)" if (folder / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE}{pickled}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as handle:
            for key in handle.keys():
                name = key.removeprefix(_PREFIX)
                if "lora_embedding" in name or "lora_magnitude_vector" in name:
                    raise AdapterError(f"{folder}: {key}: adapted embeddings and DoRA magnitudes are not served")
                found = _LORA_TENSOR.match(name)
                if found is None:
                    raise AdapterError(f"{folder}: {key} is not a LoRA tensor (lora_A / lora_B weight)")
                pairs.setdefault(found["module"], {})[found["which"]] = handle.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise AdapterError(f"{weights}: not a readable safetensors file ({exc})") from None
    if not pairs:
        raise AdapterError(f"{weights}: holds no LoRA weights")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules = []
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{folder}: {name} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{folder}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
        rank = int(a.shape[0])
        if rank != _pattern_value(rank_pattern, name, config["r"]):
            raise AdapterError(f"{folder}: {name} has rank {rank}, its config says {config['r']}")
        if rank > max_rank:
            raise AdapterError(
                f"{folder}: rank {rank} ({name}) is over --max-lora-rank {max_rank}; start the server with "
                f"--max-lora-rank {rank} or more"
            )
        alpha = float(_pattern_value(alpha_pattern, name, config["lora_alpha"]))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(ModuleAdapter(name, a, b, scale))
    base = config.get("base_model_name_or_path")
    return PeftAdapter(folder, int(config["r"]), base if isinstance(base, str) else None, modules)
