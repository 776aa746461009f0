"""Llama 2/3 (and Mistral, the same network): the decoder-only transformer
that Qwen2 and Qwen3 extend in their own files.

Module names mirror Hugging Face's so checkpoint names map one to one, except
that q/k/v and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from aioserve.attention.backend import AttentionMetadata
from aioserve.cpu.elementwise import elementwise_kernels
from aioserve.layers.activation import gate_up_and_silu
from aioserve.layers.embedding import VocabParallelEmbedding
from aioserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aioserve.flashinfer.qk_rope_store import QK_ROPE_STORE
from aioserve.layers.norm import QkNorm, RMSNorm, qk_norm_arguments
from aioserve.layers.rotary import RotaryEmbedding
from aioserve.models.decoder_lm import DecoderLM, DecoderModel
from aioserve.models.model_config import ModelConfig


class LlamaAttention(nn.Module):
    qkv_bias_default = False  # Qwen2 overrides: its q/k/v always carry a bias

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.sliding_windows[layer_id]
        bias = config.attention_bias or self.qkv_bias_default
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, bias
        )
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.rotary = rotary

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def qk_norm(self) -> QkNorm | None:
        """The per-head q and k RMSNorms the fused kernel applies (Qwen3's); None: none."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        proj = self.qkv_proj
        q, k, v = self.qkv_proj(hidden).split([proj.q_size, proj.kv_size, proj.kv_size], dim=-1)
        tokens = hidden.shape[0]
        q = q.reshape(tokens, proj.num_heads, self.head_dim)
        k = k.reshape(tokens, proj.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, proj.num_kv_heads, self.head_dim)
        fused = self._fused_qk_rope_store(positions, q, k, v, meta)
        if fused is None and q.is_cpu:
            fused = self._native_qk_rope_store(positions, q, k, v, meta)
        if fused is not None:  # q normed and rotated; k and v in the pool
            out = meta.attend(self.layer_id, fused, k, v, self.scale, self.sliding_window, stored=True)
            return self.o_proj(out.reshape(tokens, -1))
        q, k = self.normalize_qk(q, k)
        q, k = self.rotary(positions, q, k)
        out = meta.attend(self.layer_id, q, k, v, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(tokens, -1))

    def _native_qk_rope_store(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """On CPU, the q/k norms, RoPE and the KV write as one native pass
        (native/elementwise.cpp, bit for bit the separate ops; k left normed
        and rotated where it lies, for this step's prompt attention): q
        ready for attention, else None (the separate ops then run)."""
        kernels = elementwise_kernels()
        if kernels is None or positions.dim() != 1:  # M-RoPE's three axes: the separate path
            return None
        destination = meta.native_kv_destination(self.layer_id)
        if destination is None:
            return None
        q_weight, k_weight, eps = qk_norm_arguments(self.qk_norm())
        if not kernels.qk_norm_rope_store_fuses(q, destination.keys, q_weight, k_weight):
            return None  # e.g. a float32 norm weight, which promotes the normed head: the separate ops
        out: torch.Tensor = kernels.qk_norm_rope_store(
            positions, q, k, v, self.rotary.cos_cache, self.rotary.sin_cache, q_weight, k_weight, eps,
            destination.keys, destination.values, destination.slots)
        return out

    def _fused_qk_rope_store(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """q/k norms, RoPE and the KV write as one kernel where it may serve
        (flashinfer/qk_rope_store.py): q ready for attention, else None (the
        separate kernels then run)."""
        if positions.dim() != 1 or not QK_ROPE_STORE.may_take(q):  # M-RoPE's three axes: the separate path
            return None
        destination = meta.kv_destination(self.layer_id)
        if destination is None:
            return None
        q_weight, k_weight, eps = qk_norm_arguments(self.qk_norm())
        weights = () if q_weight is None or k_weight is None else (q_weight, k_weight)
        cos_sin = self.rotary.cos_sin_halves()
        kernels = QK_ROPE_STORE.kernel(q, k, v, positions, cos_sin, destination.keys, destination.values,
                                       destination.slots, *weights)
        if kernels is None or QK_ROPE_STORE.verdict(kernels, q, bool(weights)) is not None:
            return None
        out: torch.Tensor = kernels.qk_rope_store(q, k, v, positions, cos_sin, q_weight, k_weight, eps,
                                                  destination.keys, destination.values, destination.slots)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size])
        self.down_proj = RowParallelLinear(size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_and_silu(self.gate_up_proj, x))


# The feed-forward block of layer `layer_id`: the dense MLP, or experts (MoE models).
MlpFactory = Callable[[ModelConfig, int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        mlp_factory: MlpFactory,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_id, rotary)
        self.mlp = mlp_factory(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: norm(x + residual).
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(DecoderModel):
    def __init__(self, config: ModelConfig, attention_cls: type[LlamaAttention], mlp_factory: MlpFactory) -> None:
        super().__init__()
        self.rotary = rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, attention_cls, mlp_factory) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """The layers with their type (a ModuleList's items are plain Modules to a type checker)."""
        return cast("list[LlamaDecoderLayer]", list(self.layers))

    def new_step(self) -> None:
        self.rotary.new_step()


class LlamaForCausalLM(DecoderLM):
    attention_cls: type[LlamaAttention] = LlamaAttention
    model: LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, LlamaModel(config, self.attention_cls, self.build_mlp))

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return LlamaMLP(config)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's network; its sliding window comes from the config."""
