"""Qwen2 / Qwen2.5: Llama's network with a bias on the q, k and v projections."""

from __future__ import annotations

from aioserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias_default = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
