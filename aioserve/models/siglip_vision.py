"""SigLIP's vision transformer (the tower of Gemma 3 4B-27B): a strided
convolution cuts the image into patches, a learned position embedding per
patch, pre-norm encoder layers (LayerNorm, multi-head attention with biases,
a tanh-GELU MLP), a final LayerNorm; no pooling head (Gemma 3 pools in its
projector). Every patch attends to every other patch of its image.

Plain torch modules, replicated on every tensor-parallel rank, named as the
checkpoints name them (`vision_model.embeddings.patch_embedding`,
`vision_model.encoder.layers.<i>.self_attn.q_proj`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SiglipVisionConfig":
        """From a checkpoint's `vision_config` (transformers' SigLIP defaults
        for what it leaves out, as Gemma 3's published configs do)."""
        return cls(
            hidden_size=raw.get("hidden_size", 768),
            intermediate_size=raw.get("intermediate_size", 3072),
            num_hidden_layers=raw.get("num_hidden_layers", 12),
            num_attention_heads=raw.get("num_attention_heads", 12),
            image_size=raw.get("image_size", 224),
            patch_size=raw.get("patch_size", 16),
            num_channels=raw.get("num_channels", 3),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-6),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, patches, hidden]"""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(size, size), nn.Linear(size, size), nn.Linear(size, size)
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, size = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, -1).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(attended.transpose(1, 2).reshape(batch, length, size))


class SiglipMLP(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


class SiglipVisionModel(nn.Module):
    """The tower as checkpoints nest it (`vision_tower.vision_model.*`)."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = SiglipVisionTransformer(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> last hidden states [B, patches, hidden]"""
        return self.vision_model(pixel_values)
