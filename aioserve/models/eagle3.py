"""EAGLE-3's draft head, as its published checkpoints hold it
(`LlamaForCausalLMEagle3`: e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, the
SpecForge-trained Qwen3 heads).

One decoder layer that reads two things per position: the target's hidden
states from three of its layers (low, middle, high), concatenated and
projected by `fc` from 3 x the target's hidden size to the head's, and the
embedding of the *next* token (the target's own embedding table: the head
has none of its own). Its attention takes both side by side (q/k/v read
2 x hidden), so its draft position i pairs the target's features at i with
the token at i + 1 and predicts the token at i + 2. To draft further the
head feeds itself: its own pre-norm output stands in for the target's
features (no `fc` then, it is already the head's width).

Its LM head covers a smaller vocabulary (`draft_vocab_size`, the tokens the
head was trained to propose); `d2t` maps a draft id to the target's:
target = draft + d2t[draft]. Checkpoint names: `fc.weight`,
`midlayer.{input_layernorm,hidden_norm,self_attn.*,post_attention_layernorm,mlp.*}`,
`norm.weight`, `lm_head.weight`, `d2t` (and `t2d`, the reverse mask, not
needed here), with or without a `model.` prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aioserve.attention.backend import AttentionMetadata
from aioserve.layers.embedding import ParallelLMHead
from aioserve.layers.linear import QKVParallelLinear, ReplicatedLinear
from aioserve.layers.norm import RMSNorm
from aioserve.layers.rotary import RotaryEmbedding
from aioserve.models.llama import LlamaAttention, LlamaMLP
from aioserve.models.model_config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's one layer: sizes, heads, rope (read like any Llama config)
    target_hidden_size: int  # the width of each of the target's three hidden states
    draft_vocab_size: int
    # The target layers whose output the head reads, from its config
    # (eagle_config.eagle_aux_hidden_state_layer_ids); None: the default
    # (engine/eagle3_draft.py's aux_layers).
    aux_layer_ids: tuple[int, ...] | None
    # Some heads (SpecForge's option) normalise the fed hidden state before it
    # becomes the residual; the published Llama heads after.
    norm_before_residual: bool

    @classmethod
    def from_path(cls, path: Path) -> "Eagle3Config":
        raw = json.loads((path / "config.json").read_text())
        arch = (raw.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{path}: config.json's architecture is {arch!r}, not an EAGLE-3 head ({', '.join(ARCHITECTURES)})"
            )
        layer = ModelConfig.from_dict(raw)
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (len(ids) != NUM_AUX_LAYERS or not all(isinstance(i, int) for i in ids)):
            raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids must be {NUM_AUX_LAYERS} layer indices, got {ids!r}")
        if layer.num_layers != 1:
            raise ValueError(f"{path}: an EAGLE-3 head has one decoder layer, config.json says {layer.num_layers}")
        return cls(
            layer=layer,
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            aux_layer_ids=tuple(ids) if ids is not None else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )


class Eagle3Attention(LlamaAttention):
    """Llama's attention over [embedding | hidden]: q/k/v read twice the width."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, rotary)
        self.qkv_proj = QKVParallelLinear(
            2 * config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, config.attention_bias
        )


class Eagle3Layer(nn.Module):
    def __init__(self, config: Eagle3Config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        layer = config.layer
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)  # the token's embedding
        self.hidden_norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)  # the fed hidden state
        self.self_attn = Eagle3Attention(layer, 0, rotary)  # the head's KV pool has one layer
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.mlp = LlamaMLP(layer)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual before it): the caller's final norm adds them."""
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden  # (read into `both` before the norm below adds into it in place)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        both = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        out = self.self_attn(positions, both, meta)
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Eagle3Head(nn.Module):
    """fc -> the layer -> the final norm -> the draft vocabulary's LM head.
    Module names follow the checkpoint's (`checkpoint_name` maps `midlayer`)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        layer = config.layer
        self.config = config
        self.rotary = RotaryEmbedding(layer.head_dim, layer.max_position_embeddings, layer.rope_theta, layer.rope_scaling)
        self.fc = ReplicatedLinear(NUM_AUX_LAYERS * config.target_hidden_size, layer.hidden_size, bias=False)
        self.layer = Eagle3Layer(config, self.rotary)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, layer.hidden_size)
        # draft id -> its offset to the target's id; zeros where the vocabularies are one.
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long), persistent=False)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor's name here; None for those not used (the
        reverse map t2d; an embedding copy: the target's own is read)."""
        name = name.removeprefix("model.")
        if name == "t2d" or name.startswith("embed_tokens."):
            return None
        return name.replace("midlayer.", "layer.", 1)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`embeds`: the next tokens' embeddings [T, H]; `hidden`: the target's
        three states [T, 3 x target H] or the head's own [T, H]. Returns
        (normed [T, H] for the LM head, pre-norm [T, H] to feed back)."""
        self.rotary.new_step()
        if hidden.shape[-1] != self.config.layer.hidden_size:
            hidden = self.fc(hidden)
        out, residual = self.layer(positions, embeds, hidden, meta)
        normed, prenorm = self.norm(out, residual)
        return normed, prenorm

    def propose(self, normed: torch.Tensor) -> torch.Tensor:
        """The likeliest token of each row (top-1 chains, as vLLM's and
        SGLang's EAGLE drafts by default), in the target's vocabulary."""
        draft = self.lm_head(normed).argmax(dim=-1)
        return draft + self.d2t[draft]
