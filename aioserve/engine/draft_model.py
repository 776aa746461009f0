"""Loading speculative decoding's draft model (the draft_model method).

The draft is a second, smaller causal LM of the same vocabulary: its
proposals are token ids the target verifies, so they must mean the same
tokens. It is loaded beside the target, before the KV pool is sized, so
that its weights are counted out of the memory the pool may take and its
pool's pages are counted in (loading.pool_pages): the draft's KV pool has
the target's page geometry (engine/draft_runner.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from aioserve.config import ConfigError, EngineConfig
from aioserve.kvcache.kv_pool import KVPool
from aioserve.models.causal_lm import CausalLM, vision_language
from aioserve.models.model_config import ModelConfig
from aioserve.models.source import resolve_model_path
from aioserve.models.weight_loader import build_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedDraft:
    model_path: Path
    model_config: ModelConfig
    model: CausalLM


def check_draft(draft: ModelConfig, target: ModelConfig, path: Path) -> None:
    """Refuse a draft that cannot propose for this target, before its weights load."""
    if target.is_encoder or target.vision is not None:
        raise ConfigError(
            "speculative decoding with a draft model serves text-only decoder targets in this version of aioserve "
            f"(the target is {target.architecture})"
        )
    if draft.is_encoder or draft.vision is not None:
        raise ConfigError(f"the draft model {path} ({draft.architecture}) is not a text-only causal LM")
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model {path} has a vocabulary of {draft.vocab_size} tokens and the target "
            f"{target.vocab_size}: a draft must share the target's tokenizer and vocabulary size"
        )


def load_draft(
    config: EngineConfig, draft_path: str, target: ModelConfig, dtype: torch.dtype,
    weight_dtype: torch.dtype, device: torch.device,
) -> LoadedDraft:
    """The draft's weights in the target's compute dtype (rounded to its weight dtype)."""
    path = resolve_model_path(draft_path, None)
    model_config = ModelConfig.from_path(path)
    check_draft(model_config, target, path)
    model = build_model(model_config, path, dtype, device, config.load_format, config.seed, round_to=weight_dtype)
    if vision_language(model) is not None:  # a checkpoint whose config did not say so
        raise ConfigError(f"the draft model {path} is a vision-language model; a draft must be text-only")
    logger.info("draft model: %s (%s, %d layers)", path, model_config.architecture, model_config.num_layers)
    return LoadedDraft(path, model_config, model)


def draft_bytes_per_page(draft: ModelConfig, page_size: int, kv_dtype: torch.dtype, tp_size: int = 1) -> int:
    """What one page of the draft's KV pool takes on a rank (the same pages as the target's)."""
    return KVPool.bytes_per_page(draft.num_layers, page_size, draft.kv_heads_per_rank(tp_size), draft.head_dim, kv_dtype)
