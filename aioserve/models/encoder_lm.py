"""What every encoder model here (models/bert.py, bert_classification.py)
shows the rest of aioserve, beside the `CausalLM` members it must have.

An encoder is called like a decoder, `model(input_ids, positions, meta) ->
[T, hidden]` (Hugging Face's `last_hidden_state`), and says so with
`is_encoder = True`: its attention must be planned not causal
(AttentionShape.causal False), each request whole in one step. It has no
LM head: `lm_head` and `compute_logits` raise. A sequence classifier adds
`score_head` ([N, hidden] rows -> float32 logits [N, num_labels]) and
`score_row`, which row of each sequence the head reads.

Checkpoint names: an encoder maps each tensor name to its own with
`checkpoint_name` (the weight loader asks for it), which also strips the
prefix that a task model's checkpoint puts before the encoder's tensors
(`bert.`, `roberta.`) and returns None for tensors it has no use for.
"""

from __future__ import annotations

import torch
from torch import nn

from aioserve.layers.embedding import ParallelLMHead


class NoLMHeadError(TypeError):
    """An encoder asked for next-token logits."""


class EncoderLM(nn.Module):
    """The members every encoder shares; a family adds its config, its
    `embed_tokens`, `decoder_layers` and forward."""

    is_encoder = True
    logits_are_head_outputs = False  # no LM head

    @property
    def lm_head(self) -> ParallelLMHead:
        raise NoLMHeadError(f"{type(self).__name__} is an encoder: it has no LM head")

    @property
    def final_norm(self) -> nn.Module:
        raise NoLMHeadError(f"{type(self).__name__} is an encoder: it has no final norm before an LM head")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NoLMHeadError(
            f"{type(self).__name__} is an encoder: it computes embeddings or sequence scores, not next-token logits"
        )

    def head_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)  # raises: no head

    def checkpoint_name(self, name: str) -> str | None:
        """The module path (and parameter) a checkpoint tensor loads into, or None to skip it."""
        raise NotImplementedError
