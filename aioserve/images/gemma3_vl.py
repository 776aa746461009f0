"""Gemma 3 4B-27B: an image is one fixed-size crop (pixel_values [1, C, S, S]:
the processor resizes it), always `mm_tokens_per_image` (256) soft tokens
between <start_of_image> and <end_of_image>, attended both ways.

The chat template writes <start_of_image> once per image; transformers'
processor replaces it in the *text* with a blank line, the marker, the soft
tokens, <end_of_image> and a blank line, and tokenizes that, so newlines
merge with the template's own ("\\n" + "\\n\\n" is one token). The count is
fixed, so intake does the same before tokenizing a chat (rewrite_text);
expand_images then finds each image's run already in place. A raw prompt's
ids (/generate) get the marker's run inserted instead.
"""

from __future__ import annotations

from typing import Any

import torch

from aioserve.images.family import ImageTokens, TokenLookup, VisionFamily, config_token_id

START, SOFT, END = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


class Gemma3Vision(VisionFamily):
    name = "Gemma 3"
    architectures = frozenset({"Gemma3ForConditionalGeneration"})
    tensor_names = ("pixel_values",)
    bidirectional = True

    def __init__(self, tokens: ImageTokens, count: int) -> None:
        super().__init__(tokens, START)
        self.count = count

    @classmethod
    def applies(cls, config: dict[str, Any]) -> bool:
        return bool(config.get("vision_config"))  # without a tower the wrapper is served as its text model

    @classmethod
    def from_config(cls, config: dict[str, Any], token_id: TokenLookup) -> Gemma3Vision:
        start = config_token_id(config, "boi_token_index", START, token_id)
        soft = config_token_id(config, "image_token_index", SOFT, token_id)
        end = config_token_id(config, "eoi_token_index", END, token_id)
        count = int(config.get("mm_tokens_per_image", 256))
        return cls(ImageTokens(placeholder_id=start, pad_id=soft, before=(start,), after=(end,)), count)

    def configure_processor(self, hf_processor: Any) -> None:
        # Pan-and-scan (extra crops of a large image, each 256 tokens more) is
        # not served: a checkpoint's processor that turns it on is turned off.
        if getattr(hf_processor, "do_pan_and_scan", False):
            hf_processor.do_pan_and_scan = False

    def measure(self, tensors: dict[str, torch.Tensor]) -> tuple[int, tuple[int, int, int]]:
        crops = tensors["pixel_values"].reshape(-1, *tensors["pixel_values"].shape[-3:]).shape[0]
        if crops != 1:  # pan-and-scan is off: one crop per image
            raise RuntimeError(f"the image processor made {crops} crops of one image (do_pan_and_scan is not served)")
        return self.count, (1, 1, self.count)

    def rewrite_text(self, text: str) -> str:
        return text.replace(START, f"\n\n{START}{SOFT * self.count}{END}\n\n")
