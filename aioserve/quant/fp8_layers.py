"""Which linear layers of an FP8 checkpoint keep their weights in e4m3 and
multiply them as FP8, how such a layer holds them (and widens them again),
and the self-check a block-scaled layer passes before its first request.

Per-tensor scales: each scale becomes its rows' scale; per-channel scales
(compressed-tensors' "channel" strategy) are already one per row; both run
torch's row-wise scaled matmul (fp8_linear.py). 128 x 128 block scales: the
blocks' own scales, torch's 1x128 x 128x128 scaled matmul (fp8_block_linear.py).
A layer holding FP8 gets the matching LinearQuant (ROWWISE or BLOCKWISE),
which its forward asks. A layer whose shapes or device fail the kernel's
contract is dequantised at load, as on a CPU (fp8_checkpoint.py). The
experts, the embeddings and the LM head stay wide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from aioserve.layers.linear import ColumnParallelLinear, QuantizableLinear, RowParallelLinear
from aioserve.quant.fp8_block_linear import (BLOCK, block_fp8_linear, block_scaled_mm_reason, dequantize_held,
                                             scale_columns, self_check_error)
from aioserve.quant.fp8_linear import FP8, scaled_fp8_linear, scaled_mm_reason

logger = logging.getLogger(__name__)

FP8Linear = ColumnParallelLinear | RowParallelLinear
# An FP8 product: (x, e4m3 weight, its scales, bias) -> x W^T (+ b) in x's dtype.
Fp8Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Fp8Product:
    """A layer's FP8 product, by one kernel over its e4m3 weight and its
    scales: the LinearQuant (layers/linear.py) its forward asks."""

    def __init__(self, kernel: Fp8Kernel) -> None:
        self.kernel = kernel

    def apply(self, layer: QuantizableLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, layer.weight, cast(torch.Tensor, layer.weight_scale), bias)


ROWWISE = Fp8Product(scaled_fp8_linear)  # a scale per row (per-tensor or per-channel checkpoints)
BLOCKWISE = Fp8Product(block_fp8_linear)  # a scale per 128 x 128 block


def use_fp8_weight(layer: QuantizableLinear, blocks: bool = False) -> None:
    """Hold the layer's weight in e4m3, before loading. Its scales: one per
    row (loaded beside it, as the bias is: the same rows of the same
    shards), or, with `blocks`, a [N/128, K/128] grid (load_block_scale) kept
    in the first columns of [N/128, L4] (fp8_block_linear.py: the operand is
    its transposed view)."""
    rows, cols = layer.weight.shape
    device = layer.weight.device
    layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8, device=device), requires_grad=False)
    shape = (rows // BLOCK, scale_columns(cols // BLOCK)) if blocks else (rows,)
    layer.weight_scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
    layer.quant = BLOCKWISE if blocks else ROWWISE


def dequantize_weight(layer: QuantizableLinear, dtype: torch.dtype) -> None:
    """Back to a wide weight of `dtype` holding the FP8 values times their
    scales (a block-scaled layer that failed its self-check)."""
    scale = layer.weight_scale
    if scale is None:
        return
    weight = layer.weight
    wide = dequantize_held(weight, scale) if scale.dim() == 2 else weight.float() * scale[:, None]
    layer.weight = nn.Parameter(wide.to(dtype), requires_grad=False)
    layer.weight_scale = None
    layer.quant = None


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
    model: nn.Module, block: tuple[int, int] | None, device: torch.device, dtype: torch.dtype, mode: str,
    stored_fp8: set[int] | None = None,
) -> None:
    """Before loading: hold each linear layer's weight in e4m3 where the
    scaled matmul's contract holds (mode "auto"), or wherever the layer's
    pieces allow ("force": the CPU tests of the path); else it loads
    dequantised. With `stored_fp8` (ids of the layers the checkpoint stores
    FP8 weights for), a layer the checkpoint left wide (a compressed-tensors
    `ignore` entry, a `modules_to_not_convert`) stays wide. Logs how many,
    and each distinct reason for the others once."""
    if mode == "off":
        return
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
                use_fp8_weight(module, blocks=block is not None)
                held += 1
            else:
                reasons.add(reason)
    kernel = "torch's 1x128 x 128x128 block-scaled scaled_mm" if block else "torch._scaled_mm, row-wise scales"
    logger.info("FP8 weights: %d linear layers multiply in FP8 (%s)%s", held, kernel,
                f"; the others wide: {'; '.join(sorted(reasons))}" if reasons else "")


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
                dequantize_weight(module, dtype)
                failed.setdefault(reason, []).append(name)
    for reason, names in failed.items():
        logger.warning("block-scaled FP8 self-check: %s; dequantised to %s: %s", reason, dtype,
                       ", ".join(names) if len(names) <= 4 else f"{names[0]} and {len(names) - 1} more layers")
    return sum(len(names) for names in failed.values())
