"""Block-scaled FP8 weights multiplied as FP8 on a GPU: e4m3 weights with one
float32 scale per 128 x 128 block (the layout of the published Qwen3-FP8 and
DeepSeek checkpoints, `weight_scale_inv`), activations quantised per token
per 128-column group as they come, and one call of torch's scaled matmul
(`torch.nn.functional.scaled_mm`, recipes BlockWise1x128 x BlockWise128x128)
with bfloat16 out.

Operand layouts (torch's checks, torch/_meta_registrations.py
`_check_scaled_mm_sizes_v2`, mirroring aten's CUDA ones): the activations
[M, K] e4m3 row-major; the weight [K, N] column-major (our row-major [N, K]
transposed); the activation scales float32 [M, K/128] with strides [1, M];
the weight scales float32 [L4, N/128] with strides [1, L4], L4 = K/128
rounded up to a multiple of 4. A layer holds its scales as [N/128, L4] (the
checkpoint's [N/128, K/128] in the first columns, the rest never read), so
the operand is a transposed view, with nothing computed per call.

cuBLASLt also takes only a multiple of 4 rows (M): measured on an H100
(torch 2.11, CUDA 13.0), every M in {1, 2, 3, 7, 15, 17, 33} raised
CUBLAS_STATUS_NOT_SUPPORTED from its heuristic for every K and N tried,
while every M in {4, 8, 16, ..., 256} ran (tools/gpu/probe_block_fp8.py);
torch's meta checks do not know this. So the activations are padded with
zero rows to a multiple of 4 and the product's extra rows dropped.

The contract (`block_scaled_mm_reason`): CUDA, compute capability 9.x (torch
runs this recipe through cuBLASLt on Hopper; Blackwell is not relied on),
bfloat16 out, K and N multiples of 128, and torch's own layout checks,
which run on the "meta" device on any machine: the contract calls the very
function the layer calls, on meta tensors of the shapes, strides and dtypes
the GPU will get, and turns torch's error into the reason.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from aioserve.quant.fp8_linear import E4M3_MAX, FP8

BLOCK = 128  # rows and columns of a weight block; columns of an activation group
CUBLAS_ROW_MULTIPLE = 4  # cuBLASLt's block-scaled FP8 takes M only in multiples of 4 (see above)
# Token counts the contract and the self-check try: a decode row, and an odd prefill.
PROBE_ROWS = (1, 7)
# The self-check's limit on |FP8 product - exact product| / max |exact product|:
# both products multiply the same e4m3 values by the same scales, so what
# remains is accumulation order and the bfloat16 output (~0.4 %); a wrong
# scale layout is off by tens of percent.
SELF_CHECK_TOLERANCE = 0.02


def scale_columns(k_blocks: int) -> int:
    """L4: the weight scales' leading dimension, K/128 rounded up to a multiple of 4."""
    return -(-k_blocks // 4) * 4


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Each element's scale: a [ceil(rows / br), ceil(cols / bc)] grid of
    block scales spread over a [rows, cols] weight (edge blocks may be partial)."""
    br, bc = block
    return scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 [N/128, K/128] scales) of a wide weight whose
    dims are multiples of 128: each block's largest magnitude maps to e4m3's largest."""
    n, k = weight.shape
    blocks = weight.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    quantised = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return quantised.reshape(n, k), scale


def quantize_activation_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K] row-major, float32 scales [M, K/128] with strides [1, M])
    of activations [M, K]: one scale per token per 128 columns (dynamic)."""
    m, k = rows.shape
    groups = rows.float().reshape(m, k // BLOCK, BLOCK)
    scale = (groups.abs().amax(dim=-1) / E4M3_MAX).clamp(min=1e-12)
    quantised = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(m, k)
    # Outer-dim-major, as the kernel reads them. (Strides set outright: a
    # transposed copy of one token's scales would keep its row-major strides.)
    outer_major = torch.empty_strided((m, k // BLOCK), (1, m), dtype=torch.float32, device=rows.device)
    return quantised, outer_major.copy_(scale)


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T (+ b) with W e4m3 [N, K] and its block scales held [N/128, L4]:
    x quantised per token per 128 columns, one scaled matmul, out in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    padding = -m % CUBLAS_ROW_MULTIPLE
    if padding:  # zero rows: their scales clamp to 1e-12 and their products are dropped
        rows = F.pad(rows, (0, 0, 0, padding))
    quantised, x_scale = quantize_activation_groups(rows)
    out = F.scaled_mm(
        quantised, weight.t(), x_scale, F.ScalingType.BlockWise1x128,
        weight_scale.t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype,
    )[:m]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], -1)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@lru_cache(maxsize=None)
def _layout_reason(in_features: int, out_features: int, out_dtype: torch.dtype) -> str | None:
    """torch's own checks of the operands `block_fp8_linear` builds, run on
    the meta device (no data, no GPU): None, or torch's refusal."""
    meta = torch.device("meta")
    weight = torch.empty(out_features, in_features, dtype=FP8, device=meta)
    scale = torch.empty(out_features // BLOCK, scale_columns(in_features // BLOCK), device=meta)
    for m in PROBE_ROWS:
        try:
            block_fp8_linear(torch.empty(m, in_features, dtype=out_dtype, device=meta), weight, scale, None)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
            return (f"torch's block-scaled FP8 matmul refuses a [{out_features}, {in_features}] weight: "
                    f"{_first_line(error)}")
    return None


def block_scaled_mm_reason(
    device: torch.device, out_dtype: torch.dtype, in_features: int, out_features: int
) -> str | None:
    """Why a [out_features, in_features] block-scaled weight cannot be
    multiplied in FP8 here; None when it can."""
    if device.type != "cuda":
        return f"FP8 GEMMs run on CUDA, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return (f"torch's 1x128 x 128x128 block-scaled FP8 GEMM runs on compute capability 9.x (Hopper), "
                f"this GPU has {capability}")
    if out_dtype != torch.bfloat16:
        return f"block-scaled FP8 GEMMs write bfloat16, not {out_dtype}"
    if in_features % BLOCK or out_features % BLOCK:
        return f"a [{out_features}, {in_features}] weight: both dims must be multiples of {BLOCK}"
    return _layout_reason(in_features, out_features, out_dtype)


def dequantize_held(weight: torch.Tensor, weight_scale: torch.Tensor, row_start: int = 0) -> torch.Tensor:
    """float32 rows [row_start, row_start + len(weight)) of a held block-scaled weight."""
    k_blocks = -(-weight.shape[1] // BLOCK)
    first, last = row_start // BLOCK, -(-(row_start + weight.shape[0]) // BLOCK)
    scale = weight_scale[first:last, :k_blocks].float()
    return weight.float() * expand_block_scales(scale, weight.shape[0], weight.shape[1], (BLOCK, BLOCK))


def self_check_error(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why this held weight's FP8 product cannot be trusted; None when it
    matches, on a few random rows, the exact product of the same quantised
    activations and the dequantised weight (float32, 2048 weight rows at a
    time: never a whole wide copy of a large weight)."""
    n, k = weight.shape
    generator = torch.Generator(device=weight.device).manual_seed(0)
    worst = 0.0
    for m in PROBE_ROWS:
        x = torch.randn(m, k, generator=generator, device=weight.device).to(dtype)
        try:
            got = block_fp8_linear(x, weight, weight_scale, None).float()
        except Exception as error:  # torch or cuBLASLt refusing at run time: the layer dequantises
            return f"{type(error).__name__}: {_first_line(error)}"
        quantised, x_scale = quantize_activation_groups(x)
        a = quantised.float() * x_scale.repeat_interleave(BLOCK, dim=1)
        exact = torch.cat([a @ dequantize_held(weight[s : s + 2048], weight_scale, s).t() for s in range(0, n, 2048)],
                          dim=1)
        if got.shape != exact.shape:
            return f"the FP8 product has shape {tuple(got.shape)}, not {tuple(exact.shape)}"
        relative = ((got - exact).abs().max() / exact.abs().max().clamp(min=1e-30)).item()
        worst = max(worst, relative if relative == relative else float("inf"))  # NaN counts as the worst
    if worst > SELF_CHECK_TOLERANCE:  # (the text names no figure: one warning covers every such layer)
        return f"the FP8 product is off the dequantised one by more than {SELF_CHECK_TOLERANCE:.0%} of its largest value"
    return None
