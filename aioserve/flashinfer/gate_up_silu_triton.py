"""The Triton kernel of gate_up_silu.py (imported only there, lazily:
Triton comes with torch's CUDA builds, not its CPU ones). What it computes
and when it is taken: gate_up_silu.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # the smallest tile tl.dot takes: rows past M are masked to zero
BLOCK_K = 128


@triton.jit
def _kernel(x_ptr, w_ptr, out_ptr, M, N, K, x_row, w_row, out_row,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program a block of BLOCK_N output columns, for every row: it reads
    those columns' gate rows (W[n]) and up rows (W[N + n]) once, accumulates
    both products in float32, and writes silu(gate) * up."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate_rows = w_ptr + cols[:, None].to(tl.int64) * w_row
    up_rows = w_ptr + (cols[:, None] + N).to(tl.int64) * w_row
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k[None, :] < K
        x = tl.load(x_ptr + rows[:, None] * x_row + k[None, :], mask=row_ok & k_ok, other=0.0)
        w_gate = tl.load(gate_rows + k[None, :], mask=col_ok & k_ok, other=0.0)
        w_up = tl.load(up_rows + k[None, :], mask=col_ok & k_ok, other=0.0)
        gate += tl.dot(x, tl.trans(w_gate))
        up += tl.dot(x, tl.trans(w_up))
    hidden = gate * tl.sigmoid(gate) * up
    out = out_ptr + rows[:, None] * out_row + cols[None, :]
    tl.store(out, hidden.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, block_n: int = 32) -> torch.Tensor:
    """As gate_up_silu.gate_up_silu_reference, in one launch: x [M, K] with
    M <= BLOCK_M, weight [2N, K] ([gate | up] rows), out [M, N]."""
    rows, depth = x.shape
    width = weight.shape[0] // 2
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        _kernel[(triton.cdiv(width, block_n),)](
            x, weight, out, rows, width, depth, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4,
        )
    return out
