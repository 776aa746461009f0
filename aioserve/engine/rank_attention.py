"""A model's attention as one tensor-parallel rank holds it: its share of
the query heads and of the KV heads (a replicated head where there are
fewer KV heads than ranks), for the attention backend and the KV pool of
the target, a draft model or an EAGLE-3 head alike."""

from __future__ import annotations

import torch

from aioserve.attention import AttentionShape
from aioserve.models.model_config import ModelConfig


def rank_attention_shape(
    config: ModelConfig, tp_size: int, q_dtype: torch.dtype,
    sliding_windows: tuple[int | None, ...] | None = None, causal: bool = True,
) -> AttentionShape:
    """`sliding_windows`: each layer's (default: the config's)."""
    return AttentionShape(
        num_qo_heads=config.num_heads // tp_size, num_kv_heads=config.kv_heads_per_rank(tp_size),
        head_dim=config.head_dim,
        sliding_windows=tuple(config.sliding_windows) if sliding_windows is None else sliding_windows,
        q_dtype=q_dtype, sm_scale=config.attention_scale, causal=causal,
    )
