"""Qwen2.5-VL: an image is the processor's patches
(pixel_values [patches, C*T*P*P]) and its patch grid (image_grid_thw
[1, 3]); the vision encoder merges merge x merge patches into one token,
so it takes t*h*w / merge^2 <|image_pad|> tokens, on a (t, h/merge,
w/merge) grid that M-RoPE positions walk."""

from __future__ import annotations

from typing import Any

import torch

from aioserve.images.family import ImageTokens, TokenLookup, VisionFamily, config_token_id

PLACEHOLDER = "<|image_pad|>"
# What the chat template writes for one image, and what a raw prompt must hold per image.
MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


class QwenVL(VisionFamily):
    name = "Qwen2.5-VL"
    architectures = frozenset({"Qwen2_5_VLForConditionalGeneration"})  # (Qwen2-VL's tower differs: not served)
    tensor_names = ("pixel_values", "image_grid_thw")
    mrope = True

    def __init__(self, tokens: ImageTokens, merge: int) -> None:
        super().__init__(tokens, MARKER)
        self.merge = merge

    @classmethod
    def from_config(cls, config: dict[str, Any], token_id: TokenLookup) -> QwenVL:
        vision = config.get("vision_config") or {}
        merge = int(vision.get("spatial_merge_size", 2))
        image_id = config_token_id(config, "image_token_id", PLACEHOLDER, token_id)
        return cls(ImageTokens(placeholder_id=image_id, pad_id=image_id), merge)

    def measure(self, tensors: dict[str, torch.Tensor]) -> tuple[int, tuple[int, int, int]]:
        t, h, w = (int(n) for n in tensors["image_grid_thw"].reshape(-1, 3)[0])
        if h % self.merge or w % self.merge:
            # The processor's merge_size disagrees with the encoder's (checked at load; this is a bug).
            raise RuntimeError(f"an image grid of {h}x{w} patches does not merge {self.merge}x{self.merge}")
        return t * h * w // self.merge**2, (t, h // self.merge, w // self.merge)
