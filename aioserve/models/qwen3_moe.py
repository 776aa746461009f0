"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse mixture of experts
in place of the MLP on the layers the config makes sparse
(`decoder_sparse_step`, `mlp_only_layers`); the others keep a dense MLP of
`intermediate_size`. No shared experts."""

from __future__ import annotations

from torch import nn

from aioserve.models.llama import LlamaMLP
from aioserve.models.model_config import ModelConfig
from aioserve.models.sparse_moe import sparse_block
from aioserve.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        if config.moe is not None and config.moe.sparse_layers[layer_id]:
            return sparse_block(config)
        return LlamaMLP(config)
