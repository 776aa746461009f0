"""The mixture-of-experts facts of a config.json (Qwen3-MoE, Mixtral)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # the top-k weights rescaled to sum to one
    sparse_layers: list[bool]  # per layer: experts (True) or the dense MLP

    @classmethod
    def from_dict(cls, raw: dict[str, Any], num_layers: int) -> "MoeConfig | None":
        """None for a dense model. Mixtral: every layer sparse, always
        renormalised, experts of `intermediate_size`. Qwen3-MoE: layers
        whose (index + 1) is a multiple of `decoder_sparse_step` and that
        `mlp_only_layers` does not name, renormalised by `norm_topk_prob`."""
        experts = raw.get("num_experts") or raw.get("num_local_experts")  # Qwen3-MoE is written with either
        if not experts:
            return None
        if raw.get("moe_intermediate_size"):  # Qwen3-MoE
            step = raw.get("decoder_sparse_step", 1) or 1
            dense = set(raw.get("mlp_only_layers") or [])
            sparse = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
            return cls(experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"],
                       bool(raw.get("norm_topk_prob", False)), sparse)
        return cls(experts, raw["num_experts_per_tok"], raw["intermediate_size"], True, [True] * num_layers)

