"""What the rest of aioserve needs of a model: the `CausalLM` protocol.

The registry hands out factories of it; the engine (loading, the forward,
the logits, the TP layout, CUDA graphs), the CPU's fast paths (packing, the
greedy screen) and the benchmarks depend on it, never on a family's class.
It is structural: a family is any torch module with these members, so a new
one (a vision-language model, say) plugs in without subclassing another
family. Llama and Gemma 3 get them from `models/decoder_lm.py`.

The encoders (BERT, XLM-R: `is_encoder` True, models/encoder_lm.py) have the
same members so that they load and run through the same engine, but no LM
head: their `lm_head` and `compute_logits` raise, and their attention is
planned not causal (AttentionShape.causal).

Only what a model must expose is here. Where a caller truly needs one
family's layout (the CPU's native DecoderStack reproduces Llama's layers
kernel for kernel), it checks for that concrete class itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from aioserve.attention.backend import AttentionMetadata
from aioserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aioserve.models.model_config import ModelConfig


class CausalLM(Protocol):
    """A decoder over token ids: embeddings, decoder layers (one per KV pool
    layer), a final norm and the LM head."""

    # True for an encoder: bidirectional attention over whole sequences, no LM head.
    is_encoder: bool
    # Whether compute_logits returns the LM head's outputs as they are (no
    # softcap): a greedy token may then be the head's own argmax.
    logits_are_head_outputs: bool

    @property
    def config(self) -> ModelConfig:
        """The config the model was built from (its sizes, its layers' windows)."""

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The input embedding (this rank's vocabulary rows); a tied LM head shares its weight."""

    @property
    def lm_head(self) -> ParallelLMHead:
        """hidden -> logits: the greedy screen reads its weight."""

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last decoder layer and the LM head."""

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers in order: layer i reads and writes the KV pool's layer i."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token of the step: [T, hidden]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary for the given rows, valid
        until the next call (the LM head may reuse their memory)."""

    def head_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's outputs in its own dtype (compute_logits before its
        float32 copy), where `logits_are_head_outputs`."""

    # A model is a torch module tree: these two come from torch.nn.Module.
    # The engine walks the modules (experts' kernels, packing the CPU's
    # matmul weights, what a TP rank holds); benchmarks count parameters.
    def modules(self) -> Iterator[nn.Module]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


# (rows [M] int64 of a step's tokens, the input embeddings [M, hidden] they take)
ImageEmbeds = tuple[torch.Tensor, torch.Tensor]


class VisionLanguageModel(CausalLM, Protocol):
    """A decoder that also reads images (Qwen2.5-VL): a vision encoder gives
    each image the input embeddings of its placeholder tokens."""

    def encode_images(self, images: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [its placeholder tokens, hidden] in the
        model's dtype, from its processor's tensors (image_inputs.ProcessedImage.tensors,
        on the model's device); one encoder pass over them all."""

    def vision_modules(self) -> list[nn.Module]:
        """The vision tower and its projector: they compute in their weights'
        dtype (the engine may widen them where half math is slow)."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        image_embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        """As CausalLM's, and the rows `image_embeds` names take its
        embeddings instead of their tokens'. `positions` is [3, T] for M-RoPE
        steps with images (image_inputs.mrope_positions), else [T]."""


def vision_language(model: CausalLM) -> VisionLanguageModel | None:
    """The model as a vision-language model, if it is one."""
    return cast(VisionLanguageModel, model) if callable(getattr(model, "encode_images", None)) else None


# What the registry maps an architecture name to: a model class, built from
# its config with empty weights (models/weight_loader.py fills them).
ModelClass = Callable[[ModelConfig], CausalLM]
