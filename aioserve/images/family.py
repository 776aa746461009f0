"""A vision-language family as intake sees it: which processor outputs an
image keeps, how many tokens it takes in the prompt and on what grid, and
which token ids stand for it. One subclass per family (qwen_vl.py,
gemma3_vl.py); registry.py picks it from config.json."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# A token's id in the served tokenizer, by its text (None: not in the vocabulary).
TokenLookup = Callable[[str], int | None]


@dataclass(frozen=True)
class ImageTokens:
    """How one image stands in a prompt's ids. The chat template writes
    `placeholder_id` once per image; intake replaces each with `before`,
    then the image's run of `pad_id` (one per row of its embedding), then
    `after`. Qwen2.5-VL: <|image_pad|> becomes a run of <|image_pad|>."""

    placeholder_id: int
    pad_id: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()


class VisionFamily(ABC):
    name: ClassVar[str]
    architectures: ClassVar[frozenset[str]]  # config.json's architectures[0] of this family's checkpoints
    tensor_names: ClassVar[tuple[str, ...]]  # the processor outputs an image keeps (its ProcessedImage.tensors)
    mrope: ClassVar[bool] = False  # positions are M-RoPE's three axes (PromptImages.mrope)
    bidirectional: ClassVar[bool] = False  # an image's tokens attend to each other both ways

    def __init__(self, tokens: ImageTokens, marker: str) -> None:
        self.tokens = tokens
        # What a raw prompt (SGLang's /generate text) writes where an image
        # goes: what the chat template writes for one.
        self.marker = marker

    @classmethod
    def applies(cls, config: dict[str, Any]) -> bool:
        """Whether a checkpoint of one of `architectures` takes images."""
        return True

    def configure_processor(self, hf_processor: Any) -> None:
        """Settle the checkpoint's processor to what the model is served with
        (Gemma 3: one crop per image)."""

    def rewrite_text(self, text: str) -> str:
        """A rendered chat prompt as it is tokenized when it has images: a
        family whose images take a fixed run of tokens writes the run into
        the text, as its processor does (Gemma 3); others leave it."""
        return text

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any], token_id: TokenLookup) -> VisionFamily:
        """The family's numbers from the checkpoint's config.json (and its tokenizer)."""

    @abstractmethod
    def measure(self, tensors: dict[str, torch.Tensor]) -> tuple[int, tuple[int, int, int]]:
        """One processed image's token count and its token grid (time, height, width)."""


def config_token_id(config: dict[str, Any], key: str, text: str, token_id: TokenLookup) -> int:
    """A special token's id: config.json's `key` (top level, or its
    text_config), else the tokenizer's id of `text`. A ValueError when
    neither has it (the checkpoint cannot take images)."""
    text_config = config.get("text_config")
    configured = config.get(key, text_config.get(key) if isinstance(text_config, dict) else None)
    known = token_id(text)
    if isinstance(configured, int):
        if known is not None and known != configured:
            raise ValueError(
                f"config.json's {key} is {configured}, but the tokenizer's {text} is {known}: the chat template's "
                "image placeholders would not be found"
            )
        return configured
    if known is None:
        raise ValueError(f"neither config.json ({key}) nor the tokenizer ({text}) gives the image token's id")
    return known
