"""The MLP's [gate | up] projection and SiLU-and-mul as one kernel, for the
few rows of a small decode batch.

A dense decoder layer on a GPU launches nine kernels at batch 1
(benchmarks/kernel_census.py), and there a step is bound by launches and
their gaps, not by bytes: Qwen3-0.6B's 28 layers took 1.63 ms on an H200
against 0.29 ms of weight reads. Two of the nine are the gate|up GEMM and
FlashInfer's SiLU-and-mul, which reads back what the GEMM just wrote. No
library call fuses an activation into a GEMM's epilogue, so this one is
aioserve's own, in Triton: one program per block of output columns reads
those columns' gate rows and up rows once, accumulates both products in
float32 for every row (tl.dot on a 16-row tile: up to MAX_ROWS rows), and
writes silu(gate) * up. Its result differs from the two kernels' by
rounding only: gate and up are not rounded to half before the activation.

Taken (unless AIOSERVE_GATE_UP_SILU=0) for up to MAX_ROWS rows of an
unquantised, bias-free projection without LoRA, where its contract holds
(contracts.gate_up_silu), and only after a self-check on the device, once
per dtype, shape and row bucket: with the layer's own weight, the kernel at
each column block must equal the layer's separate kernels, and the fastest
block must beat them, each timed in a CUDA graph of TIMED_CALLS calls (as
the decode step replays them); else the separate kernels serve (logged).
The CPU tests run the torch form through the same calls
(tests/fake_flashinfer.py's stand-in enforces the contract), Triton's
interpreter runs the kernel's code, and the GPU test compiles it.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from aioserve.flashinfer import contracts
from aioserve.flashinfer.elementwise import MODEL_OPS, SelfCheckedOp
from aioserve.flashinfer.loader import OptionalModule

logger = logging.getLogger(__name__)

MAX_ROWS = contracts.GATE_UP_SILU_MAX_ROWS  # one tl.dot tile; past it cuBLAS's GEMM tiles pay for the extra launch
BLOCK_N_CHOICES = (16, 32, 64)  # output columns a program: the self-check times each, the fastest serves
TIMED_CALLS = 20
SELF_CHECK_TOLERANCE = 2e-2  # relative, in half precision: the separate kernels round gate and up first
# AIOSERVE_GATE_UP_SILU=0 keeps the separate kernels (benchmarks/gpu_check.sh times both).
ENABLED = os.environ.get("AIOSERVE_GATE_UP_SILU", "1") != "0"

# Device time of one call of a function, in microseconds (None: not timed, as on CPU).
Timer = Callable[[Callable[[], object]], float]


def gate_up_silu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch form: x [M, K], weight [2N, K] ([gate | up] rows, as the
    fused projection holds them); silu(x Wg^T) * (x Wu^T) in float32,
    rounded once to x's dtype: [M, N]."""
    gate_up = F.linear(x.float(), weight.float())
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


# Triton comes with torch's CUDA builds (and with xgrammar), not everywhere: imported on first use.
KERNEL = OptionalModule(
    "triton", lambda: importlib.import_module("aioserve.flashinfer.gate_up_silu_triton"),
    "the MLP's gate|up GEMM and SiLU-and-mul stay separate kernels",
)


def cuda_graph_microseconds(call: Callable[[], object]) -> float:
    """One call's device time, replayed as a CUDA graph of TIMED_CALLS calls:
    launch gaps count as they do in a captured decode step, host time does not."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(TIMED_CALLS):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / TIMED_CALLS


def default_timer(device: torch.device) -> Timer | None:
    return cuda_graph_microseconds if device.type == "cuda" else None


def self_check(kernels: Any, weight: torch.Tensor, rows: int, separate: Callable[[torch.Tensor], torch.Tensor],
               timer: Timer | None) -> tuple[str | None, int]:
    """Why the kernel may not serve `rows` rows of this weight (None when it
    may), and the column block that serves: each block's output must equal
    `separate`'s (the layer's own kernels) on random rows, and with a timer
    the fastest block must beat them."""
    gen = torch.Generator().manual_seed(rows)
    probe = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype).to(weight.device)
    expected = separate(probe).float()
    scale = expected.abs().max().item() + 1.0
    for block_n in BLOCK_N_CHOICES:
        try:
            got = kernels.gate_up_silu(probe, weight, block_n)
        except Exception as exc:  # a compile or launch failure: the separate kernels serve
            logger.warning("gate_up_silu failed its self-check: %s: %s", type(exc).__name__, exc)
            return f"it failed its self-check ({type(exc).__name__}: {exc})", 0
        error = (got.float() - expected).abs().max().item() / scale
        if not error <= SELF_CHECK_TOLERANCE:
            logger.warning("gate_up_silu's block of %d columns differed from the separate kernels by %.3g", block_n,
                           error)
            return f"its block of {block_n} columns differed from the separate kernels by {error:.3g} (relative)", 0
    if timer is None:
        return None, BLOCK_N_CHOICES[1]
    times = {block_n: timer(lambda: kernels.gate_up_silu(probe, weight, block_n)) for block_n in BLOCK_N_CHOICES}
    best = min(times, key=lambda block_n: times[block_n])
    baseline = timer(lambda: separate(probe))
    shape = f"{rows} rows of {weight.shape[1]} -> {weight.shape[0] // 2}"
    if times[best] >= baseline:
        return f"it took {times[best]:.1f} us against the separate kernels' {baseline:.1f} us ({shape})", best
    logger.info("gate_up_silu: %.1f us against %.1f us (%s, blocks of %d columns)", times[best], baseline, shape, best)
    return None, best


def row_bucket(rows: int) -> int:
    """The self-check's row count for `rows`: the next power of two (the
    captured decode sizes up to MAX_ROWS are 1, 2, 4, 8, 16)."""
    return 1 << (rows - 1).bit_length()


class GateUpSiluOp(SelfCheckedOp):
    """The contract's decisions per layout, and per dtype, shape and row
    bucket the self-check's verdict and the column block that serves."""

    # Most refusals are timings (cuBLAS was faster for this shape): expected, not a fault.
    # A kernel that fails or differs is logged as a warning by self_check itself.
    refusal_level = logging.INFO

    def __init__(self) -> None:
        super().__init__("gate_up_silu", contracts.gate_up_silu)
        self.block_n: dict[tuple[object, ...], int] = {}
        self.timer: Callable[[torch.device], Timer | None] = default_timer  # the CPU tests put a fake timer here

    def load(self) -> ModuleType | None:
        module: ModuleType | None = KERNEL.load()
        return module

    def may_take(self, first: torch.Tensor) -> bool:
        return ENABLED and 0 < first.shape[0] <= MAX_ROWS and super().may_take(first)

    def run(self, kernels: Any, x: torch.Tensor, weight: torch.Tensor,
            separate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """silu(gate) * up by the kernel, or None where the self-check (run
        once per key; never while a CUDA graph captures) refused it."""
        rows = row_bucket(x.shape[0])
        key = (x.dtype, tuple(weight.shape), rows, str(x.device))
        if key not in self.verdicts and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # undecided: a capture cannot time or sync (the warm-up step before it decides)

        def check() -> str | None:
            why, self.block_n[key] = self_check(kernels, weight, rows, separate, self.timer(x.device))
            return why

        serves = f"{rows} rows of {weight.shape[1]} -> {weight.shape[0] // 2} ({x.dtype})"
        if self.checked(key, check, serves) is not None:
            return None
        out: torch.Tensor = kernels.gate_up_silu(x, weight, self.block_n[key])
        return out

    def forget(self) -> None:
        super().forget()
        self.block_n.clear()


GATE_UP_SILU = GateUpSiluOp()
MODEL_OPS.append(GATE_UP_SILU)  # reported once a layer asked for it
