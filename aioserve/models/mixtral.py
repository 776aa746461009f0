"""Mixtral: Mistral's network (its sliding window from the config) with a
sparse mixture of experts, renormalised top-k, on every layer. Hugging Face
names the block `block_sparse_moe` and an expert's projections w1 (gate),
w3 (up) and w2 (down); the weight loader maps them onto `mlp.experts`."""

from __future__ import annotations

from torch import nn

from aioserve.models.llama import MistralForCausalLM
from aioserve.models.model_config import ModelConfig
from aioserve.models.sparse_moe import sparse_block


class MixtralForCausalLM(MistralForCausalLM):
    hf_module_renames = {"block_sparse_moe": "mlp"}

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return sparse_block(config)
