"""FP8 weights multiplied as FP8 on a GPU: e4m3 weights with one scale per
output row, activations quantised per token as they come, and torch's
scaled matmul (`torch._scaled_mm`, row-wise scales) with bfloat16 out.

Used for FP8 checkpoints with per-tensor or per-channel scales on CUDA
devices where the contract below holds: each weight's per-tensor scale
becomes its rows' scale, so the checkpoint's e4m3 values are multiplied as
they are. Block-scaled checkpoints (128 x 128) take fp8_block_linear.py; a
layer neither contract admits is dequantised at load (fp8_checkpoint.py).

The contract (torch's checks for row-wise scaled_mm, aten/src/ATen/native/
cuda/Blas.cpp): compute capability 9.0 or newer, bfloat16 output, mat1
row-major and mat2 column-major (a row-major [N, K] weight transposed), both
of K and N multiples of 16, scales float32 of [M, 1] and [1, N].
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(FP8).max  # 448
MIN_CAPABILITY = (9, 0)


def scaled_mm_reason(device: torch.device, out_dtype: torch.dtype, in_features: int, out_features: int) -> str | None:
    """Why the row-wise FP8 matmul cannot take a weight of this shape here; None when it can."""
    if device.type != "cuda":
        return f"FP8 GEMMs run on CUDA, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"row-wise scaled FP8 GEMMs need compute capability 9.0 or newer, this GPU has {capability}"
    if out_dtype != torch.bfloat16:
        return f"row-wise scaled FP8 GEMMs write bfloat16, not {out_dtype}"
    if in_features % 16 or out_features % 16:
        return f"a [{out_features}, {in_features}] weight: both dims must be multiples of 16"
    return None


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 scale per row) of a wide weight: each row's largest
    magnitude maps to e4m3's largest."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).to(FP8), scale


def scaled_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T (+ b) with W e4m3 [N, K] and its rows' scales [N]: x quantised
    per token (dynamic), one scaled matmul, out in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
    quantised = (rows.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    out = torch._scaled_mm(
        quantised, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype
    )
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], -1)
