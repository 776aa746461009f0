"""Which linear layers of an FP8 checkpoint keep their weights in e4m3 and
multiply them as FP8, how such a layer loads its weight and scales, and the
self-check a block-scaled layer passes before its first request.

Per-tensor scales: each scale becomes its rows' scale; per-channel scales
(compressed-tensors' "channel" strategy) are already one per row; both run
torch's row-wise scaled matmul (layers/fp8_linear.py). 128 x 128 block
scales: the blocks' own scales, torch's 1x128 x 128x128 scaled matmul (layers/fp8_block_linear.py).
A layer whose shapes or device fail the kernel's contract is dequantised at
load, as on a CPU (models/fp8_checkpoint.py). The experts, the embeddings
and the LM head stay wide.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

import torch
from torch import nn

from aioserve.layers.fp8_block_linear import BLOCK, block_scaled_mm_reason, quantize_blocks, self_check_error
from aioserve.layers.fp8_linear import quantize_rows, scaled_mm_reason
from aioserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from aioserve.models.fp8_checkpoint import FP8_DTYPE
from aioserve.models.model_config import ModelConfig
from aioserve.models.quantization import WEIGHT_SCALE_SUFFIXES

logger = logging.getLogger(__name__)

FP8Linear = ColumnParallelLinear | RowParallelLinear


class _LazyTensor(Protocol):
    """The loader's CheckpointTensor: a name, a shape, a dtype, and slicing."""

    name: str
    shape: torch.Size
    dtype: torch.dtype

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def scale_name(hf_name: str, owner: dict[str, Any]) -> str:
    """The checkpoint name of an FP8 weight's scale (in whichever shard holds it)."""
    base = hf_name.removesuffix("weight")
    name = next((base + s for s in WEIGHT_SCALE_SUFFIXES if base + s in owner), None)
    if name is None:
        raise ValueError(f"the FP8 weight {hf_name} has no scale ({' or '.join(base + s for s in WEIGHT_SCALE_SUFFIXES)})")
    return name


def _block_reason(module: FP8Linear, device: torch.device, dtype: torch.dtype, forced: bool) -> str | None:
    """Why this layer cannot hold its weight in 128 x 128 blocks here. Every
    piece a rank holds (a tensor-parallel shard, each of q/k/v and gate/up in
    a fused layer) must start and end on a block boundary, so that its scales
    are whole rows or columns of the checkpoint's grid; a layer where one does
    not (e.g. 64-wide KV heads, or a shard of 192 rows) is dequantised."""
    rows, cols = module.weight.shape
    if any(v % BLOCK for v in module.block_boundaries()) or rows % BLOCK:
        return f"a [{rows}, {cols}] {type(module).__name__}'s pieces do not all fall on {BLOCK}-row/column blocks"
    return None if forced else block_scaled_mm_reason(device, dtype, cols, rows)


def use_fp8_matmuls(
    model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype, mode: str,
    stored_fp8: set[int] | None = None,
) -> None:
    """Before loading: hold each linear layer's weight in e4m3 where the
    scaled matmul's contract holds (mode "auto"), or wherever the layer's
    pieces allow ("force": the CPU tests of the path); else it loads
    dequantised. With `stored_fp8` (ids of the layers the checkpoint stores
    FP8 weights for), a layer the checkpoint left wide (a compressed-tensors
    `ignore` entry, a `modules_to_not_convert`) stays wide. Logs how many,
    and each distinct reason for the others once."""
    if mode == "off" or config.fp8 is None:
        return
    block = config.fp8.block
    if block is not None and block != (BLOCK, BLOCK):
        logger.info("FP8 weights in %s blocks: dequantised to %s at load (the FP8 GEMM takes %dx%d blocks)",
                    block, dtype, BLOCK, BLOCK)
        return
    held, reasons = 0, set()
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            rows, cols = module.weight.shape
            reason: str | None
            if stored_fp8 is not None and id(module) not in stored_fp8:
                reason = "left unquantised by the checkpoint"
            elif block is not None:
                reason = _block_reason(module, device, dtype, mode == "force")
            else:
                reason = None if mode == "force" else scaled_mm_reason(device, dtype, cols, rows)
            if reason is None:
                module.use_fp8_weight(blocks=block is not None)
                held += 1
            else:
                reasons.add(reason)
    kernel = "torch's 1x128 x 128x128 block-scaled scaled_mm" if block else "torch._scaled_mm, row-wise scales"
    logger.info("FP8 weights: %d linear layers multiply in FP8 (%s)%s", held, kernel,
                f"; the others wide: {'; '.join(sorted(reasons))}" if reasons else "")


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


def load_fp8_weight(module: FP8Linear, tensor: _LazyTensor, owner: dict[str, Any], shard: object) -> torch.dtype:
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
        module.load_block_scale(scale, tensor.shape, shard)
    else:
        module.load_weight("weight_scale", scale, shard)
    return torch.float32


def fill_dummy_fp8(module: FP8Linear, wide: torch.Tensor) -> None:
    """Random weights for a layer held in FP8: `wide` quantised in its form."""
    scale = module.weight_scale
    assert scale is not None
    if scale.dim() == 2:
        weight, grid = quantize_blocks(wide)
        scale.data[:, : grid.shape[1]] = grid.to(scale.device)
    else:
        weight, scale.data = (t.to(scale.device) for t in quantize_rows(wide))
    module.weight.data = weight.to(module.weight.device)


def self_check_block_fp8(model: nn.Module, dtype: torch.dtype) -> int:
    """Before the first request (and before any CUDA graph is captured):
    each block-scaled FP8 layer's product on a few random rows against the
    exact product of its dequantised weight. A layer that raises or is off
    beyond FP8's error is dequantised in place to `dtype`, with a warning
    per distinct reason. Returns how many were."""
    failed: dict[str, list[str]] = {}  # reason -> layers
    with torch.inference_mode():
        for name, module in model.named_modules():
            scale = getattr(module, "weight_scale", None)
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or scale is None or scale.dim() != 2:
                continue
            reason = self_check_error(module.weight, scale, dtype)
            if reason is not None:
                module.dequantize_weight(dtype)
                failed.setdefault(reason, []).append(name)
    for reason, names in failed.items():
        logger.warning("block-scaled FP8 self-check: %s; dequantised to %s: %s", reason, dtype,
                       ", ".join(names) if len(names) <= 4 else f"{names[0]} and {len(names) - 1} more layers")
    return sum(len(names) for names in failed.values())
