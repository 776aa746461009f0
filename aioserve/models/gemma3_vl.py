"""Gemma 3 4B-27B with its eyes open (`Gemma3ForConditionalGeneration`):
the Gemma 3 text decoder (models/gemma3.py), a SigLIP tower
(models/siglip_vision.py) and a projector that average-pools the tower's
patches to `mm_tokens_per_image` (256) soft tokens, RMS-normalises them
(Gemma's 1 + w form) and maps them to the decoder's width.

An image is a fixed-size crop (896² in the published checkpoints: the
checkpoint's image processor resizes it), so every image is 256 tokens.
Those tokens attend to each other both ways inside the decoder (the plan's
image rows say so: attention backends' masks), and to the text before them
causally, as transformers' Gemma 3 masks do.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
import torch.nn.functional as F
from torch import nn

from aioserve.models.gemma3 import Gemma3ForCausalLM
from aioserve.models.model_config import ModelConfig
from aioserve.models.siglip_vision import SiglipVisionConfig, SiglipVisionModel


class Gemma3SoftEmbNorm(nn.Module):
    """RMSNorm times (1 + w), in float32 (the checkpoint holds w)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vision: SiglipVisionConfig, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text_hidden))
        self.mm_soft_emb_norm = Gemma3SoftEmbNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.patches_per_side
        self.kernel = self.patches_per_side // int(tokens_per_image**0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision hidden] -> [B, tokens per image, text hidden]"""
        batch, _, size = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, size, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text decoder and LM head as Gemma3ForCausalLM's, plus the tower."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.vision is not None and config.vision.tokens_per_image is not None
        vision = SiglipVisionConfig.from_dict(config.vision.raw)
        self.tokens_per_image = config.vision.tokens_per_image
        self.vision_tower = SiglipVisionModel(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(vision, config.hidden_size, self.tokens_per_image)

    def vision_modules(self) -> list[nn.Module]:
        return [self.vision_tower, self.multi_modal_projector]

    def encode_images(self, images: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's 256 soft tokens [256, hidden] in the decoder's dtype:
        one tower pass over all crops of the call."""
        pixels = torch.cat([image["pixel_values"].reshape(-1, *image["pixel_values"].shape[-3:]) for image in images])
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        patches = self.vision_tower(pixels.to(dtype))
        tokens = self.multi_modal_projector(patches)  # [crops, 256, hidden]
        out_dtype = self.model.embed_tokens.weight.dtype
        counts = [image["pixel_values"].reshape(-1, *image["pixel_values"].shape[-3:]).shape[0] for image in images]
        return [chunk.reshape(-1, chunk.shape[-1]).to(out_dtype) for chunk in tokens.split(counts)]
