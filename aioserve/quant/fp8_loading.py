"""An FP8 checkpoint's weights into the linear layers that hold them in e4m3
(fp8_layers.py chose them): the e4m3 values as they are, beside them the
scales in the layer's form (one per row, or its shard of the 128 x 128 block
grid), or a weight the checkpoint left wide quantised here in that form;
and dummy weights in the same form for benchmarks without a checkpoint.
"""

from __future__ import annotations

from typing import cast

import torch

from aioserve.layers.linear import ColumnParallelLinear, QuantizableLinear, RowParallelLinear, copy_checked
from aioserve.quant.fp8_block_linear import BLOCK, quantize_blocks
from aioserve.quant.fp8_checkpoint import FP8_DTYPE, scale_name
from aioserve.quant.fp8_linear import quantize_rows
from aioserve.quant.method import LazyTensor, Owners


def _row_scales(name: str, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint weight's scale as one per row of it: a per-tensor scale
    repeated, per-channel scales ([rows, 1]) as they are. The layer then cuts
    its rows (its shard, its part of a fused layer) as it does the weight's."""
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).contiguous()
    if scale.numel() == rows and scale.shape[0] == rows:
        return scale.reshape(rows)
    raise ValueError(f"{name}: FP8 scales of {tuple(scale.shape)} for a weight of {rows} rows "
                     f"(expected one per tensor or [{rows}, 1])")


def _block_scale_grid(scale: torch.Tensor, full_shape: torch.Size, what: str) -> torch.Tensor:
    """A checkpoint's block scales, checked against its weight's shape."""
    expected = (-(-full_shape[0] // BLOCK), -(-full_shape[1] // BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: FP8 block scales of {tuple(scale.shape)} for a {list(full_shape)} weight "
                         f"in {BLOCK}x{BLOCK} blocks (expected {expected})")
    return scale.float()


def load_block_scale(layer: QuantizableLinear, scale: torch.Tensor, full_shape: torch.Size, shard: object) -> None:
    """A layer's share of a checkpoint weight's [N/128, K/128] block scales
    (`full_shape`: that weight's [N, K]): a row-parallel layer's, the
    columns its input features span; a column-parallel one's, its part's
    rows, cut as its weight rows are."""
    held = layer.weight_scale
    assert held is not None
    if isinstance(layer, RowParallelLinear):
        grid = _block_scale_grid(scale, full_shape, "weight_scale_inv")
        first, count = layer.in_start // BLOCK, layer.weight.shape[1] // BLOCK
        copy_checked(held[:, :count], grid[:, first : first + count], "weight_scale_inv")
        return
    offset, size, start, _ = (v // BLOCK for v in cast(ColumnParallelLinear, layer).part_rows(shard))
    grid = _block_scale_grid(scale, full_shape, f"weight_scale_inv[{shard}]")
    copy_checked(held[offset : offset + size, : grid.shape[1]], grid[start : start + size],
                 f"weight_scale_inv[{shard}]")


def load_fp8_weight(module: QuantizableLinear, tensor: LazyTensor, owner: Owners, shard: object) -> torch.dtype:
    """Into a layer held in FP8: the checkpoint's e4m3 values as they are,
    with its per-tensor scale as every row's, its per-channel scales as its
    rows', or its block scales; a wide
    weight (a layer the checkpoint left unquantised) quantised here in the
    layer's form. Returns the dtype the values are stored in."""
    assert module.weight_scale is not None
    blocks = module.weight_scale.dim() == 2
    if tensor.dtype != FP8_DTYPE:
        weight, scale = (quantize_blocks if blocks else quantize_rows)(tensor[:])
    else:
        name = scale_name(tensor.name, owner)
        # The lazy tensor itself: the layer reads just its rank's slice.
        weight, scale = cast(torch.Tensor, tensor), owner[name].get_tensor(name).float()
        if not blocks:
            scale = _row_scales(name, scale, tensor.shape[0])
    module.load_weight("weight", weight, shard)
    if blocks:
        load_block_scale(module, scale, tensor.shape, shard)
    else:
        module.load_weight("weight_scale", scale, shard)
    return torch.float32


def fill_dummy_fp8(module: QuantizableLinear, wide: torch.Tensor) -> None:
    """Random weights for a layer held in FP8: `wide` quantised in its form."""
    scale = module.weight_scale
    assert scale is not None
    if scale.dim() == 2:
        weight, grid = quantize_blocks(wide)
        scale.data[:, : grid.shape[1]] = grid.to(scale.device)
    else:
        weight, scale.data = (t.to(scale.device) for t in quantize_rows(wide))
    module.weight.data = weight.to(module.weight.device)
