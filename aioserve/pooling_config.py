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
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aioserve.config import ConfigError, EngineConfig

POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "classify")
_KEYS = {"pooling_type", "normalize", "task", "is_matryoshka", "matryoshka_dimensions", "classifier_from_token",
         "pair_template", "instruction"}
# Qwen3-Reranker's published prompt (its model card): the model answers "yes"
# or "no" to whether the document meets the query.
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
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
    # Matryoshka models (config.json's is_matryoshka, as vLLM reads it): a
    # prefix of the vector is an embedding too; `dimensions` may ask for one
    # (of matryoshka_dimensions' lengths only, where the model lists them).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # A causal LM scored as a reranker (Qwen3-Reranker; vLLM's
    # classifier_from_token): the score's logit is the second token's logit
    # less the first's, at the prompt's last position, and a (query, document)
    # pair is written into `pair_template` first.
    classifier_from_token: tuple[str, str] | None = None
    pair_template: str | None = None


def pair_text(pooler: PoolerConfig, query: str, document: str) -> str | None:
    """A causal reranker's prompt for a pair; None for a cross-encoder (its
    tokenizer joins the pair: [CLS] query [SEP] document [SEP])."""
    if pooler.pair_template is None:
        return None
    values = {"query": query, "document": document}  # one pass: a query may itself hold "{document}"
    return re.sub(r"\{(query|document)\}", lambda match: values[match.group(1)], pooler.pair_template)


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
    matryoshka = spec.get("is_matryoshka", base.matryoshka)
    dimensions = spec.get("matryoshka_dimensions", base.matryoshka_dimensions)
    tokens, template = spec.get("classifier_from_token", base.classifier_from_token), None
    if tokens is not None:
        if not (isinstance(tokens, (list, tuple)) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
            raise ConfigError(f"--pooler-config: classifier_from_token must be two tokens, e.g. [\"no\", \"yes\"], "
                              f"got {tokens!r}")
        task, tokens = "classify", tuple(tokens)
        template = str(spec.get("pair_template", QWEN3_RERANKER_TEMPLATE))
        instruction = str(spec.get("instruction", DEFAULT_INSTRUCTION))
        template = template.replace("{instruction}", instruction)
        if "{query}" not in template or "{document}" not in template:
            raise ConfigError("--pooler-config: pair_template must hold {query} and {document}")
    return replace(base, pooling_type=pooling_type, normalize=normalize, task=task, source=f"{base.source} + --pooler-config",
                   matryoshka=bool(matryoshka or dimensions), matryoshka_dimensions=_dimensions(dimensions),
                   classifier_from_token=tokens, pair_template=template)


def _dimensions(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value):
        raise ConfigError(f"matryoshka_dimensions must be a list of positive integers, got {value!r}")
    return tuple(value)


def _matryoshka(folder: Path, base: PoolerConfig) -> PoolerConfig:
    """config.json's Matryoshka fields (vLLM's names)."""
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
    dimensions = _dimensions(raw.get("matryoshka_dimensions"))
    if not raw.get("is_matryoshka") and dimensions is None:
        return base
    return replace(base, matryoshka=True, matryoshka_dimensions=dimensions)


def resolve_pooler(config: EngineConfig, folder: Path, architecture: str, is_encoder: bool) -> PoolerConfig | None:
    """None for a generating model; else how it pools. `--runner generate`
    on a pooling-only checkpoint (an encoder, a cross-encoder) is refused."""
    declared = read_sentence_transformers(folder)
    classifier = is_classifier(architecture)
    if config.runner == "generate":
        if classifier or is_encoder:
            raise ConfigError(f"{architecture} has no LM head and cannot generate: drop --runner generate")
        return None
    pools = declared is not None or classifier or is_encoder or config.pooler_config is not None
    if config.runner == "auto" and not pools:
        return None
    if classifier:
        base = PoolerConfig(_default_type(architecture), False, "classify", architecture)
    else:
        base = declared or PoolerConfig(_default_type(architecture), True, "embed", "--runner pooling")
    base = _matryoshka(folder, base)
    return _override(base, config.pooler_config) if config.pooler_config else base
