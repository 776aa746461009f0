"""Qwen2.5-VL's vision tower: a ViT over 14x14 patches (two frames deep)
that turns an image into one embedding per 2x2 patches, the input
embeddings of the image's placeholder tokens.

- Patch embedding: a Conv3d whose stride is its kernel, i.e. one matmul
  over each flattened patch (computed so).
- 2-D axial rotary: a quarter of each head's frequencies turn with the
  patch's row, a quarter with its column (then doubled, for rotate_half).
- Blocks: RMSNorm, attention, RMSNorm, SwiGLU MLP with biases. The blocks
  of `fullatt_block_indexes` attend over each image frame whole; the others
  within windows of `window_size` pixels (vision_layout.py).
- Patch merger: RMSNorm, then each 2x2 block of patches concatenated and
  projected by a two-layer GELU MLP to the text model's width.

Its weights are whole on every tensor-parallel rank (plain torch modules,
loaded whole by the weight loader): the tower is small beside the decoder,
and every rank then computes the same embeddings with no collective.
Module names follow the checkpoints' (`visual.blocks.<i>.attn.qkv`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from aioserve.layers.activation import activation
from aioserve.layers.norm import RMSNorm
from aioserve.layers.rotary import rotate_half
from aioserve.models.vision_layout import ImageBatchLayout, Segments, image_batch_layout

_NORM_EPS = 1e-6  # the tower's norms (transformers hard-codes it too)


@dataclass
class VisionTowerConfig:
    """config.json's vision_config, with transformers' defaults
    (Qwen2_5_VLVisionConfig) for what it leaves out."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "VisionTowerConfig":
        fields = {name: raw[name] for name in cls.__dataclass_fields__ if raw.get(name) is not None}
        if "in_chans" in raw and "in_channels" not in raw:  # the published configs' older name
            fields["in_channels"] = raw["in_chans"]
        if "depth" not in raw and raw.get("num_hidden_layers") is not None:
            fields["depth"] = raw["num_hidden_layers"]
        theta = (raw.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            fields["rope_theta"] = theta
        fields["fullatt_block_indexes"] = tuple(fields.get("fullatt_block_indexes", cls.fullatt_block_indexes))
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_blocks(self) -> int:
        """A window's side in merge blocks."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return F.silu if name == "silu" else activation(name)


class PatchEmbed(nn.Module):
    """A Conv3d with stride = kernel over [C, T, P, P] patches: computed as
    the matmul it is (the checkpoint's weight keeps its Conv3d shape)."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scale: float
) -> torch.Tensor:
    """Attention of [S, H, D] rows within each run of `segments` (both
    ways): one batched SDPA per run length, not one call per run (a large
    image has hundreds of windows, nearly all of one size)."""
    out = torch.empty_like(q)
    for rows in segments.groups:
        qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))  # [n, H, L, D]
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
    return out


class VisionAttention(nn.Module):
    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], segments: Segments) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos_sin
        # The rotation in float32 whatever the dtype, as transformers' tower has it.
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = segment_attention(q, k, v, segments, self.head_dim**-0.5)
        return self.proj(out.reshape(rows, -1))


class VisionMLP(nn.Module):
    """SwiGLU with biases (the checkpoint's separate gate and up projections)."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = _act(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionTowerConfig, full_attention: bool) -> None:
        super().__init__()
        self.full_attention = full_attention  # else within windows
        self.norm1 = RMSNorm(config.hidden_size, _NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, _NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], layout: ImageBatchLayout) -> torch.Tensor:
        segments = layout.full if self.full_attention else layout.windows
        x = x + self.attn(cast(torch.Tensor, self.norm1(x)), cos_sin, segments)
        return x + self.mlp(cast(torch.Tensor, self.norm2(x)))


class PatchMerger(nn.Module):
    """Each merge block's patches, normed and concatenated, to one token."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.width = width = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, _NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = cast(torch.Tensor, self.ln_q(x))
        return self.mlp(normed.reshape(-1, self.width))


class Qwen2_5VisionTransformer(nn.Module):
    inv_freq: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        full = set(config.fullatt_block_indexes)
        self.blocks = nn.ModuleList(VisionBlock(config, i in full) for i in range(config.depth))
        self.merger = PatchMerger(config)
        # Axial rotary: head_dim / 4 frequencies, each used for the row and for the column.
        quarter = config.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32) / quarter
        self.register_buffer("inv_freq", 1.0 / config.rope_theta**exponents, persistent=False)
        for param in self.parameters():
            param.requires_grad_(False)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, 1, head_dim] float32 cos/sin of each row's (row, col)."""
        angles = (positions[..., None].float() * self.inv_freq.float()).flatten(1)  # [rows, 2 * head_dim / 4]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()

    def forward(self, pixels: torch.Tensor, grids: Sequence[Sequence[tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Each image's token embeddings [tokens, out_hidden_size] from the
        processors' patches of all images, concatenated in order ([patches,
        C*T*P*P]), and each image's grids (time, height, width in patches)."""
        config = self.config
        layout = image_batch_layout(grids, config.spatial_merge_size, config.window_blocks, pixels.device)
        if pixels.shape[0] != layout.patch_order.shape[0]:
            raise ValueError(f"{pixels.shape[0]} patches given for grids of {layout.patch_order.shape[0]}")
        hidden = self.patch_embed(pixels)[layout.patch_order]
        cos_sin = self._cos_sin(layout.positions)
        for block in self.blocks:
            hidden = block(hidden, cos_sin, layout)
        merged = self.merger(hidden)
        tokens = torch.empty_like(merged)
        tokens[layout.unit_order] = merged  # back to the processor's order
        return list(tokens.split(layout.tokens_per_image))
