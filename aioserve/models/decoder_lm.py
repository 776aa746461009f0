"""The plumbing every decoder-only family here shares, Llama's and Gemma 3's
alike: embed the tokens, run the decoder layers with the residual add fused
into the next norm, the final norm, the LM head (tied to the embedding when
the config says so). A family builds its own layers; these two classes only
wire them, so Gemma 3 need not pose as Llama to reuse the wiring.

Module names follow Hugging Face's checkpoints (`model.embed_tokens`,
`model.layers.<i>`, `model.norm`, `lm_head`): the weight loader finds a
tensor's module by its name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aioserve.attention.backend import AttentionMetadata
from aioserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aioserve.layers.norm import RMSNorm
from aioserve.models.causal_lm import ImageEmbeds
from aioserve.models.model_config import ModelConfig


class DecoderModel(nn.Module):
    """Embeddings -> layers -> final norm. A subclass sets the three modules
    below in its `__init__` (their order there is the parameters' order,
    which dummy weights are drawn in); each layer is called as
    `layer(positions, hidden, residual, meta) -> (hidden, residual)`."""

    embed_tokens: VocabParallelEmbedding
    layers: nn.ModuleList
    norm: RMSNorm
    # Layers whose input (the residual stream entering them) the forward also
    # returns, after the final hidden states: what an EAGLE-3 head reads
    # (DecoderLM.capture_aux_hidden). Empty: the forward returns [T, hidden].
    aux_layers: tuple[int, ...] = ()

    def new_step(self) -> None:
        """Called first in every forward: the rotary embeddings forget the
        last step's rows (RotaryEmbedding.new_step)."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        image_embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        self.new_step()
        hidden = self.embed(input_ids)
        if image_embeds is not None:  # image placeholders take their encoder's rows
            rows, values = image_embeds
            hidden[rows] = values.to(hidden.dtype)
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                # (a copy: the layers' fused norms add into their residual in place)
                captured[i] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        if not self.aux_layers:
            return hidden
        return torch.cat([hidden, *(captured[i] for i in self.aux_layers)], dim=-1)


class DecoderLM(nn.Module):
    """A `DecoderModel` under `model` and the LM head: the `CausalLM`
    members (models/causal_lm.py) a family gets by subclassing this."""

    is_encoder = False  # causal attention and an LM head (the encoders: models/encoder_lm.py)
    logits_are_head_outputs = True  # compute_logits is the head's output (Gemma 3's softcap: not)

    def __init__(self, config: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(model.embed_tokens)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> RMSNorm:
        return self.model.norm

    def decoder_layers(self) -> Sequence[nn.Module]:
        return list(self.model.layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        image_embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        """Final hidden states of every token: [T, hidden]. `image_embeds`
        (a vision-language model's steps with images): rows of the step and
        the input embeddings they take instead of their tokens'."""
        return self.model(input_ids, positions, meta, image_embeds)

    def capture_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """From now on the forward returns [T, (1 + len(layers)) x hidden]:
        the final hidden states, then the input of each of `layers` in that
        order (speculative decoding's EAGLE-3 head reads them). One wide
        tensor, not a tuple, so a captured CUDA graph's static output holds
        them as well; the engine splits it."""
        self.model.aux_layers = tuple(layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary for the given rows, valid
        until the next call (the LM head may reuse their memory)."""
        return self.lm_head(hidden).float()

    def head_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's outputs in its own dtype, no float32 copy: what a
        greedy row's argmax needs where `logits_are_head_outputs` (the
        copy is exact, so the argmax is the same)."""
        return self.lm_head(hidden)
