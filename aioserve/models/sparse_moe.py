"""The sparse block (router and experts) a MoE model's config describes."""

from __future__ import annotations

from aioserve.layers.moe import SparseMoeBlock
from aioserve.models.model_config import ModelConfig


def sparse_block(config: ModelConfig) -> SparseMoeBlock:
    """The router and experts one sparse layer of `config` holds."""
    moe = config.moe
    if moe is None:
        raise ValueError(f"{config.architecture}: config.json names no experts")
    return SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.renormalize)
