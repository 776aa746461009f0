"""What a pooling model (an embedder or a reranker) makes of its hidden
states, read from the checkpoint and the flags its users type.

A sentence-transformers folder says it itself: `modules.json` lists the
modules (Transformer, Pooling, Normalize), `1_Pooling/config.json` names the
pooling mode (`pooling_mode_cls_token`, `pooling_mode_mean_tokens`,
`pooling_mode_lasttoken`), a `Normalize` module L2-normalises, and
`config_sentence_transformers.json` may hold query/document prompts. A
`*ForSequenceClassification` architecture is a cross-encoder: it scores.
Flags, as vLLM and SGLang spell them: `--runner pooling` (SGLang:
`--is-embedding`) serves any supported checkpoint as an embedder, and
`--pooler-config '{"pooling_type": "MEAN", "normalize": true}'` overrides
what the folder says.

It imports only config.py: the loader resolves it once at start; the
scheduler plans pooling rows by it and the server shapes responses by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioserve.config import ConfigError, EngineConfig

POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "classify")
_KEYS = {"pooling_type", "normalize", "task"}
# sentence-transformers' 1_Pooling/config.json -> ours: the flags its folders
# have long held, and the one `pooling_mode` string newer versions write.
_ST_FLAGS = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_MODE_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # LAST | MEAN | CLS: which hidden rows make a sequence's vector
    normalize: bool  # L2-normalise the vector (sentence-transformers' Normalize module)
    task: str = "embed"  # embed: /v1/embeddings; classify: the model's score head (rerank, score)
    source: str = "flags"  # where it was read from, for the start-up log


def is_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def read_sentence_transformers(folder: Path) -> PoolerConfig | None:
    """The pooling a sentence-transformers folder declares; None if it is no such folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    pooling_type = "CLS"
    if "Pooling" in kinds:
        pooling_file = folder / kinds["Pooling"] / "config.json"
        settings = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
        if "pooling_mode" in settings:
            asked = [str(settings["pooling_mode"])]
            chosen = [_ST_MODE_NAMES[mode] for mode in asked if mode in _ST_MODE_NAMES]
        else:
            asked = sorted(name for name, value in settings.items() if name.startswith("pooling_mode") and value)
            chosen = [_ST_FLAGS[name] for name in asked if name in _ST_FLAGS]
        if len(asked) != 1 or len(chosen) != 1:
            raise ConfigError(f"{pooling_file}: pooling {asked} is not supported (one of cls, mean or lasttoken is)")
        pooling_type = chosen[0]
    return PoolerConfig(pooling_type, "Normalize" in kinds, "embed", f"{modules_file.name}")


def _default_type(architecture: str) -> str:
    """Encoders read their first token ([CLS]); a decoder has seen the whole
    sequence only at its last."""
    return "CLS" if architecture.startswith(("Bert", "XLMRoberta", "Roberta")) else "LAST"


def _override(base: PoolerConfig, spec: dict[str, Any]) -> PoolerConfig:
    unknown = set(spec) - _KEYS
    if unknown:
        raise ConfigError(f"--pooler-config: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    pooling_type = str(spec.get("pooling_type", base.pooling_type)).upper()
    if pooling_type not in POOLING_TYPES:
        raise ConfigError(f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
    normalize = spec.get("normalize", base.normalize)
    if not isinstance(normalize, bool):
        raise ConfigError(f"--pooler-config: normalize must be true or false, got {normalize!r}")
    task = spec.get("task", base.task)
    if task not in TASKS:
        raise ConfigError(f"--pooler-config: task must be one of {', '.join(TASKS)}, got {task!r}")
    return PoolerConfig(pooling_type, normalize, task, f"{base.source} + --pooler-config")


def resolve_pooler(config: EngineConfig, folder: Path, architecture: str) -> PoolerConfig | None:
    """None for a generating model; else how it pools. `--runner generate`
    on a pooling-only checkpoint (a cross-encoder) is refused."""
    declared = read_sentence_transformers(folder)
    classifier = is_classifier(architecture)
    if config.runner == "generate":
        if classifier:
            raise ConfigError(f"{architecture} scores text pairs and cannot generate: drop --runner generate")
        return None
    if config.runner == "auto" and declared is None and not classifier and config.pooler_config is None:
        return None
    if classifier:
        base = PoolerConfig(_default_type(architecture), False, "classify", architecture)
    else:
        base = declared or PoolerConfig(_default_type(architecture), True, "embed", "--runner pooling")
    return _override(base, config.pooler_config) if config.pooler_config else base
