"""Whether a FusedMoE layer's experts run as FlashInfer's fused MoE kernel.

`flashinfer.fused_moe.cutlass_fused_moe` (TensorRT-LLM's CUTLASS MoE) does
the routing permutation, both grouped GEMMs with SwiGLU between them and the
routing-weighted sum in one call, where the grouped torch form
(layers/moe.py) is a sort, a gather, two grouped matmuls, an activation and
a scatter-add. It is taken only where three things hold:

- its contract (contracts.fused_moe) for the input layout, asked once per
  layout like the elementwise ops (elementwise.py);
- the kernel exists: its first call JIT-builds a large module, which the
  project's trimmed GPU bundle does not carry, so a failure to import or
  build is a reason, logged once, not an error;
- a self-check, once per weight shape and outside CUDA graph capture: the
  kernel and the grouped torch form run on a few synthetic rows over the
  layer's first experts and must agree. The kernel's fc1 wants each
  expert's rows as [up | gate] (it computes silu(second half) * first
  half) where aioserve's w13 holds [gate | up]; that reading of its
  documentation cannot be checked without a GPU, so the check guards it
  (and the routing weights' use) on the real kernel.

When the kernel is chosen the layer's w13 is reordered to [up | gate] in
place, once: a second copy in the kernel's order would double the experts'
memory, nearly all of a MoE's weights. The torch form, still taken for a
layout the contract refuses, then swaps the halves of its gate/up product
back (layers/moe.py). On CUDA the choice is made at load
(engine/loading.py); elsewhere (the CPU tests' stand-in) at the first
forward. AIOSERVE_FLASHINFER_MOE=0 (or `ENABLED = False`) keeps the torch form.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType

import torch

from aioserve.flashinfer import contracts, elementwise
from aioserve.flashinfer.elementwise import SelfCheckedOp

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("AIOSERVE_FLASHINFER_MOE", "1") != "0"
SELF_CHECK_ROWS = 16
SELF_CHECK_EXPERTS = 4  # the layer's first experts: the check is about the kernel's reading of the layout, not E
# Relative to the output's norm: half-precision rounding leaves well under 1%, a swapped gate/up or a
# lost routing weight changes the output by tens of percent. An elementwise absolute tolerance would
# pass a swapped gate/up whenever the outputs are small.
SELF_CHECK_TOLERANCE = 0.05

# The grouped torch form over stacked [gate | up] experts: (x, routing weights, expert ids, w13, w2) -> out.
TorchForm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ShapeKey = tuple[int, int, torch.dtype, str]  # hidden, intermediate per rank, dtype, device type


class FusedMoeOp(SelfCheckedOp):
    """The contract's decisions per layout, and the self-check's verdict per
    weight shape (SelfCheckedOp)."""

    def __init__(self) -> None:
        super().__init__("fused_moe", contracts.fused_moe)

    def may_take(self, first: torch.Tensor) -> bool:
        return ENABLED and super().may_take(first)

    def verdict(self, fi: ModuleType, w13: torch.Tensor, w2: torch.Tensor, torch_form: TorchForm) -> str | None:
        """Why the kernel may not serve these weights' shape, from its self-check, run once per shape."""
        key: ShapeKey = (w2.shape[1], w2.shape[2], w2.dtype, w2.device.type)
        return self.checked(key, lambda: self_check(fi, w13, w2, torch_form),
                            f"experts of hidden {key[0]}, intermediate {key[1]} ({w2.dtype})")


FUSED_MOE = FusedMoeOp()
elementwise.MODEL_OPS.append(FUSED_MOE)


def run_kernel(
    fi: ModuleType, x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor,
    w13_up_first: torch.Tensor, w2: torch.Tensor,
) -> torch.Tensor:
    """One unquantised call on this rank's shards (tp_size 1: the caller all-reduces)."""
    result = fi.fused_moe.cutlass_fused_moe(
        x, expert_ids, routing_weights, w13_up_first, w2, x.dtype, quant_scales=None
    )
    return result[0] if isinstance(result, (list, tuple)) else result  # some versions return [output]


def swap_halves_(w13: torch.Tensor) -> None:
    """[gate | up] <-> [up | gate] along each expert's rows, in place, one
    expert's half at a time (no second copy of the stack)."""
    half = w13.shape[1] // 2
    for expert in w13:
        first = expert[:half].clone()
        expert[:half].copy_(expert[half:])
        expert[half:].copy_(first)


def failure_line(text: str) -> str:
    """The line of a failure's text that says what failed: a JIT build's
    exception opens with "Ninja build failed. Ninja output:" and names the
    cause (a missing source, a compiler error) further down."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() or "no such file" in line.lower():
            return line[:300]
    return lines[0][:300] if lines else ""


def self_check(fi: ModuleType, w13: torch.Tensor, w2: torch.Tensor, torch_form: TorchForm) -> str | None:
    """Run the kernel and the torch form on synthetic rows over the first
    experts (w13 in aioserve's [gate | up] order); why they disagree, or why
    the kernel could not run, else None."""
    experts = min(SELF_CHECK_EXPERTS, w13.shape[0])
    top_k = min(2, experts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SELF_CHECK_ROWS, w13.shape[2], generator=gen).to(w13)
    rows = torch.arange(SELF_CHECK_ROWS)[:, None]
    expert_ids = ((rows + torch.arange(top_k)[None, :]) % experts).to(device=w13.device, dtype=torch.int32)
    routing_weights = torch.rand(SELF_CHECK_ROWS, top_k, generator=gen) + 0.25  # unequal, not renormalised
    routing_weights = routing_weights.to(w13.device)
    gate_up, down = w13[:experts].clone(), w2[:experts].clone()  # copies: the check reorders its own
    reference = torch_form(x, routing_weights, expert_ids.long(), gate_up, down).float()
    swap_halves_(gate_up)
    try:
        got = run_kernel(fi, x, expert_ids, routing_weights, gate_up, down).float()
    except Exception as exc:  # noqa: BLE001 - an import, build or launch failure is a reason to use torch
        logger.debug("fused_moe: the kernel did not run:\n%s", exc)
        return f"the kernel did not run ({type(exc).__name__}: {failure_line(str(exc))})"
    if got.shape != reference.shape:
        return f"the kernel returned {tuple(got.shape)} for {tuple(reference.shape)}"
    error = float((got - reference).norm() / reference.norm().clamp_min(1e-12))
    if not error <= SELF_CHECK_TOLERANCE:  # NaN fails too
        return (f"its self-check differs from the grouped torch form by {error:.1%} of the output "
                f"(over {SELF_CHECK_TOLERANCE:.0%}: the weight order or routing weights are read otherwise)")
    return None


class FlashInferExperts:
    """One FusedMoE layer's use of the kernel: chosen once (`choose`), then
    asked per input layout (`run`). `up_first`: the layer's w13 was
    reordered to the kernel's [up | gate]."""

    def __init__(self, torch_form: TorchForm) -> None:
        self.torch_form = torch_form
        self.chosen: bool | None = None  # None: not decided yet
        self.up_first = False

    @torch.inference_mode()
    def choose(self, w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """Decide for this layer, once, outside graph capture: the contract
        for its usual layout (contiguous rows of its dtype), then the shape's
        self-check; reorder w13 in place when the kernel is taken."""
        if self.chosen is None:
            probe = w13.new_zeros(1, w13.shape[2])
            ids = torch.zeros(1, 1, dtype=torch.int32, device=w13.device)
            fi = FUSED_MOE.kernel(probe, ids, ids.float(), w13, w2)
            self.chosen = fi is not None and FUSED_MOE.verdict(fi, w13, w2, self.torch_form) is None
            if self.chosen:
                swap_halves_(w13)
                self.up_first = True
        return self.chosen

    def run(
        self, x: torch.Tensor, routing_weights: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor | None:
        """The experts' output (before the all-reduce) from the kernel, or
        None: the caller takes the torch form."""
        if self.chosen is False or not FUSED_MOE.may_take(x):
            return None
        if self.chosen is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return None  # a self-check cannot run inside a capture: this graph keeps the torch form
            if not self.choose(w13, w2):
                return None
        ids = expert_ids.to(torch.int32).contiguous()
        weights = routing_weights.to(torch.float32).contiguous()
        fi = FUSED_MOE.kernel(x, ids, weights, w13, w2)
        return None if fi is None else run_kernel(fi, x, ids, weights, w13, w2)
