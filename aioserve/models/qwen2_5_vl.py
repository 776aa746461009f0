"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2's text decoder
(q/k/v with a bias) with M-RoPE, and a vision tower (qwen2_5_vision.py)
whose outputs are the input embeddings of an image's placeholder tokens.

The decoder is Qwen2's, unchanged: its rotary is built from the config's
`mrope_section` (layers/rotary.py), so a step with images passes [3, T]
positions and a step of text only passes [T], where M-RoPE is plain RoPE
and every fast path (the CPU's native decode step, CUDA graphs) applies.
`DecoderModel.forward` puts the tower's rows in place of the placeholders'.

Checkpoints name the text model's tensors `model.*` and the tower's
`visual.*` (as published), or `model.language_model.*` and `model.visual.*`
(as transformers 5 lays them out); both load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from aioserve.models.model_config import ModelConfig
from aioserve.models.qwen2 import Qwen2ForCausalLM
from aioserve.models.qwen2_5_vision import Qwen2_5VisionTransformer, VisionTowerConfig

logger = logging.getLogger(__name__)

# transformers 5's names -> ours (the published checkpoints' own).
_CHECKPOINT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if config.vision is None:
            raise ValueError(f"{config.architecture}: config.json has no vision_config")
        if not config.uses_mrope:
            raise ValueError(f"{config.architecture}: the text config has no mrope_section")
        super().__init__(config)
        tower = VisionTowerConfig.from_dict(config.vision.raw)
        if tower.out_hidden_size != config.hidden_size:
            raise ValueError(
                f"the vision tower's out_hidden_size {tower.out_hidden_size} != the text model's {config.hidden_size}"
            )
        if tower.spatial_merge_size != config.vision.spatial_merge_size:
            raise ValueError("the vision config's spatial_merge_size disagrees with the tower's")
        self.visual = Qwen2_5VisionTransformer(tower)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this model's modules have it."""
        for prefix, replacement in _CHECKPOINT_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix):]
        return name

    def vision_modules(self) -> list[nn.Module]:
        return [self.visual]

    def encode_images(self, images: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's placeholder embeddings [tokens, hidden] in the
        model's dtype, from its processor's `pixel_values` and
        `image_grid_thw`: all images in one tower pass."""
        if not images:
            return []
        grids = [
            [(int(t), int(h), int(w)) for t, h, w in image["image_grid_thw"].reshape(-1, 3).tolist()]
            for image in images
        ]
        pixels = torch.cat([image["pixel_values"] for image in images])
        dtype = self.embed_tokens.dtype
        return [tokens.to(dtype) for tokens in self.visual(pixels, grids)]
