"""FP8 checkpoint weights read as the values they stand for: an e4m3 weight
times its scale, one per tensor, one per output row (compressed-tensors'
"channel" strategy) or one per block (`weight_block_size`, 128 x 128 in
Qwen3-FP8), dequantised to float32 as a layer reads its slice.
The layers then hold them in the compute dtype, as an unquantised
checkpoint's (unless they hold FP8 for the GPU's FP8 GEMMs: fp8_layers.py)."""

from __future__ import annotations

from typing import Any

import torch

from aioserve.layers.fp8_block_linear import expand_block_scales
from aioserve.models.quantization import Fp8Config

FP8_DTYPE = torch.float8_e4m3fn


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, config: Fp8Config) -> torch.Tensor:
    """float32 weight * scale: one scale (any shape of one element), one per
    row ([rows, 1] or [rows], strategy "channel"), or one per `block` of rows
    x columns ([ceil(rows / br), ceil(cols / bc)]; edge blocks may be partial)."""
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    rows, cols = values.shape
    if scale.numel() == 1:
        return values * scale.reshape(())
    if config.strategy == "channel":
        if scale.numel() != rows or scale.dim() > 2 or scale.shape[0] != rows:
            raise ValueError(f"per-channel FP8 scales of {tuple(scale.shape)} for a [{rows}, {cols}] weight "
                             f"(expected [{rows}, 1])")
        return values * scale.reshape(rows, 1)
    if config.block is None:
        raise ValueError(f"a per-tensor FP8 scale has one element, not {tuple(scale.shape)}")
    br, bc = config.block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 block scales of {tuple(scale.shape)} for a [{rows}, {cols}] weight in "
                         f"{br}x{bc} blocks (expected {expected})")
    return values * expand_block_scales(scale, rows, cols, config.block)


class Fp8CheckpointTensor:
    """An e4m3 CheckpointTensor and its scale, indexed like the loader's
    CheckpointTensor (`t[a:b]`, `t[:, a:b]`, `t[:]`) but giving float32
    values. The whole weight is read and dequantised for each slice (one
    byte per value; a block's scale covers rows and columns a slice may cut)."""

    def __init__(self, weight: Any, scale: torch.Tensor, config: Fp8Config) -> None:
        self.name = weight.name
        self.shape = weight.shape
        self.dtype = torch.float32
        self._weight = weight
        self._scale = scale
        self._config = config

    def __getitem__(self, index: object) -> torch.Tensor:
        return dequantize_fp8(self._weight[:], self._scale, self._config)[index]  # type: ignore[index]
