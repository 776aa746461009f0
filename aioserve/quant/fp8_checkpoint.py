"""FP8 checkpoint weights read as the values they stand for: an e4m3 weight
times its scale, one per tensor, one per output row (compressed-tensors'
"channel" strategy) or one per block (`weight_block_size`, 128 x 128 in
Qwen3-FP8), dequantised to float32 as a layer reads its slice.
The layers then hold them in the compute dtype, as an unquantised
checkpoint's (unless they hold FP8 for the GPU's FP8 GEMMs: fp8_layers.py).
And the other tensors an FP8 checkpoint has beside a weight: its scale's
name, and the static scales that are not used."""

from __future__ import annotations

from typing import Any

import torch

from aioserve.quant.fp8_block_linear import expand_block_scales

FP8_DTYPE = torch.float8_e4m3fn
# The checkpoint tensors FP8 quantisation adds beside a weight: its scale
# (per tensor, per channel or per block; Qwen3-FP8 and DeepSeek name the
# block form `weight_scale_inv`, though it multiplies) and static activation scales.
WEIGHT_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
ACTIVATION_SCALE_SUFFIX = "input_scale"
# A compressed-tensors kv_cache_scheme's static KV scales (on the attention
# module, or as k_proj / v_proj `output_scale` in older checkpoints): the KV
# cache here is not quantised with them.
KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "output_scale")
# All of them: read with their weight, or not used (activations and the KV cache are not quantised with them).
SIDE_SUFFIXES = (*WEIGHT_SCALE_SUFFIXES, ACTIVATION_SCALE_SUFFIX, *KV_SCALE_SUFFIXES)


def scale_name(hf_name: str, owner: dict[str, Any]) -> str:
    """The checkpoint name of an FP8 weight's scale (in whichever shard holds it)."""
    base = hf_name.removesuffix("weight")
    name = next((base + s for s in WEIGHT_SCALE_SUFFIXES if base + s in owner), None)
    if name is None:
        raise ValueError(f"the FP8 weight {hf_name} has no scale ({' or '.join(base + s for s in WEIGHT_SCALE_SUFFIXES)})")
    return name


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, strategy: str, block: tuple[int, int] | None
) -> torch.Tensor:
    """float32 weight * scale: one scale (any shape of one element), one per
    row ([rows, 1] or [rows], strategy "channel"), or one per `block` of rows
    x columns ([ceil(rows / br), ceil(cols / bc)]; edge blocks may be partial)."""
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    rows, cols = values.shape
    if scale.numel() == 1:
        return values * scale.reshape(())
    if strategy == "channel":
        if scale.numel() != rows or scale.dim() > 2 or scale.shape[0] != rows:
            raise ValueError(f"per-channel FP8 scales of {tuple(scale.shape)} for a [{rows}, {cols}] weight "
                             f"(expected [{rows}, 1])")
        return values * scale.reshape(rows, 1)
    if block is None:
        raise ValueError(f"a per-tensor FP8 scale has one element, not {tuple(scale.shape)}")
    br, bc = block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 block scales of {tuple(scale.shape)} for a [{rows}, {cols}] weight in "
                         f"{br}x{bc} blocks (expected {expected})")
    return values * expand_block_scales(scale, rows, cols, block)


class Fp8CheckpointTensor:
    """An e4m3 CheckpointTensor and its scale, indexed like the loader's
    CheckpointTensor (`t[a:b]`, `t[:, a:b]`, `t[:]`) but giving float32
    values. The whole weight is read and dequantised for each slice (one
    byte per value; a block's scale covers rows and columns a slice may cut)."""

    def __init__(self, weight: Any, scale: torch.Tensor, strategy: str, block: tuple[int, int] | None) -> None:
        self.name = weight.name
        self.shape = weight.shape
        self.dtype = torch.float32
        self._weight = weight
        self._scale = scale
        self._strategy = strategy
        self._block = block

    def __getitem__(self, index: object) -> torch.Tensor:
        return dequantize_fp8(self._weight[:], self._scale, self._strategy, self._block)[index]  # type: ignore[index]
