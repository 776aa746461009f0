"""Qwen3: Llama's network with an RMSNorm on every query and key head
(over head_dim) before RoPE, and no q/k/v bias."""

from __future__ import annotations

import torch

from aioserve.layers.norm import QkNorm, RMSNorm
from aioserve.layers.rotary import RotaryEmbedding
from aioserve.models.llama import LlamaAttention, LlamaForCausalLM
from aioserve.models.model_config import ModelConfig


class Qwen3Attention(LlamaAttention):
    norm_cls: type[RMSNorm] = RMSNorm  # Gemma 3's (1 + w) norm in its subclass

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, rotary)
        self.q_norm = self.norm_cls(config.head_dim, config.rms_norm_eps)
        # k normed where it lies in the projection (on FlashInfer's kernel), so
        # RoPE and the KV store find it beside v; q is not: attention wants
        # q dense, and a normed copy is that already.
        self.k_norm = self.norm_cls(config.head_dim, config.rms_norm_eps, in_place=True)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def qk_norm(self) -> QkNorm | None:
        # (Gemma's (1 + w) norms hold 1 + w as their weight: the plain form applies.)
        return QkNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
