"""Gemma 3 (text): Llama's attention and gated MLP arranged differently.

- Sliding-window and global layers interleaved (the config's `layer_types`,
  or every `sliding_window_pattern`-th layer global): a sliding layer
  attends to the last `sliding_window` positions through the attention
  backends' own window support, as Mistral's layers do.
- Each layer type has its own rope: the global layers' (theta 1M, maybe
  linearly scaled) and the sliding layers' (theta 10k).
- RMSNorm multiplies by (1 + w): the checkpoint's w is loaded as 1 + w, so
  every RMSNorm path (native, FlashInfer, torch) runs unchanged.
- Norms before and after both the attention and the MLP; q/k RMSNorm per
  head; the softmax scale from `query_pre_attn_scalar`; embeddings scaled by
  sqrt(hidden) (rounded to the weights' dtype, as Hugging Face does); GeGLU
  (tanh gelu) in the MLP; logits optionally soft-capped.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from aioserve.attention.backend import AttentionMetadata
from aioserve.layers.activation import gelu_tanh_and_mul
from aioserve.layers.embedding import VocabParallelEmbedding
from aioserve.layers.norm import RMSNorm
from aioserve.layers.rotary import RotaryEmbedding
from aioserve.models.decoder_lm import DecoderLM, DecoderModel
from aioserve.models.llama import LlamaMLP
from aioserve.models.model_config import ModelConfig
from aioserve.models.qwen3 import Qwen3Attention

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


class GemmaRMSNorm(RMSNorm):
    """norm(x) * (1 + w): holds 1 + w, computed in float32 at load."""

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        self.weight.data.copy_(loaded[:].float() + 1.0)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q/k norms, Gemma's (1 + w) form."""

    norm_cls = GemmaRMSNorm


class Gemma3MLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_id, rotary)
        self.mlp = Gemma3MLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layer, the residual add fused into the next norm: the
        layer's output is hidden + residual."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(DecoderModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in GELU_TANH:
            raise ValueError(f"Gemma 3 with hidden_activation {config.hidden_act!r}: only tanh gelu is supported")
        positions = config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.head_dim, positions, config.rope_theta, config.rope_scaling)
        local_theta, local_scaling = config.local_rope or (config.rope_theta, config.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, positions, local_theta, local_scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, self.local_rotary if window else self.rotary)
            for i, window in enumerate(config.sliding_windows)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[Gemma3DecoderLayer]:
        return cast("list[Gemma3DecoderLayer]", list(self.layers))

    def new_step(self) -> None:
        self.rotary.new_step()
        self.local_rotary.new_step()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale in the embeddings' dtype first (sqrt(3072) is 55.5 in bfloat16), as Hugging Face has it.
        return hidden * torch.tensor(self.embed_scale, dtype=self.embed_tokens.dtype).to(hidden.dtype)


class Gemma3ForCausalLM(DecoderLM):
    model: Gemma3Model

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, Gemma3Model(config))
        self.softcap = config.final_logit_softcapping
        self.logits_are_head_outputs = not self.softcap  # tanh can tie logits the head kept apart

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits
