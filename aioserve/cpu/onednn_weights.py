"""Weights reordered once into oneDNN's blocked layout (--cpu-matmul onednn
for every weight; for float16 math on AMX, each weight shape whose timing
at load it wins beside the BLAS forms, cpu/matmul.py's `choose`; bf16 on
AMX runs on the packed kernel's own tile path, native/gemm.cpp).

oneDNN's kernels read a weight in a blocked layout of their own (on AMX, the
tiles' pairs of bf16 rows). Given a plain [out, in] weight, as torch's matmul
and `mkldnn._linear_pointwise` are at every call, oneDNN reorders it first:
each decode step then reads every weight, writes a reordered copy and reads
that, where the weights' one read is the step's whole cost at batch 1
(Qwen3-0.6B bf16 ran at 7 tok/s on an AMX Xeon bounded at ~17 by its
bandwidth, issue 45). Reordered once at load
(`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's freezing
pass does for x86), a call reads the weight once, in oneDNN's layout.

The reordered tensor is opaque (torch's `_mkldnn` layout: shape and dtype,
no strides, no indexing). It replaces the module's weight parameter, so the
plain copy's memory goes, unless another module holds the same parameter (a
tied embedding looks rows up in it): that plain weight stays, and the LM
head multiplies by a reordered copy. Anything else that reads a replaced
weight fails loudly rather than reading the wrong numbers.

oneDNN cannot reorder half weights on every CPU (bf16 needs AVX512-BW/VL/DQ
or AVX-NE-CONVERT; float32 works on any x86), and a layout whose products
disagreed with torch's would be a silent error: every weight is reordered
and checked against `F.linear` before any module changes, and one refusal
leaves them all as they were (the caller then uses BLAS forms, saying why).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from aioserve.cpu.matmul import MatmulChoice, MatmulModule, onednn_packed_linear, onednn_reorder

logger = logging.getLogger(__name__)

CHECK_ROWS = (1, 5)  # a decode row, and a few (oneDNN may pick another kernel past one)
# Largest error of a checked product, relative to its largest value: float32
# sums in another order differ by ~1e-6; a half output is rounded to ~4e-3.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _disagreement(weight: torch.Tensor, packed: torch.Tensor) -> str | None:
    """Why the reordered weight's products are not torch's, or None."""
    generator = torch.Generator().manual_seed(0)
    tolerance = TOLERANCE.get(weight.dtype, 2e-2)
    for rows in CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
        got = onednn_packed_linear(x, packed).float()
        want = F.linear(x.float(), weight.float())
        error = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
        if not error <= tolerance:  # NaN fails too
            return (f"oneDNN's product of a reordered {tuple(weight.shape)} {weight.dtype} weight is off by "
                    f"{error:.1e} of its scale at {rows} row(s) (tolerance {tolerance:.0e})")
    return None


def shared_parameters(model: nn.Module, modules: Iterable[object]) -> set[int]:
    """ids of the matmul modules' weights that some other module holds too
    (a tied embedding): their plain copy must stay."""
    mine = {id(module) for module in modules}
    return {id(param) for module in model.modules() if id(module) not in mine
            for param in module.parameters(recurse=False)}


def pack_for_onednn(modules: Iterable[MatmulModule], shared: set[int]) -> str | None:
    """Reorder every module's weight for oneDNN and route its matmul there
    (MatmulChoice.onednn_weight); None when done, else why nothing changed.
    `shared`: weights another module reads (kept; the choice holds a copy)."""
    modules = list(modules)
    started = time.perf_counter()
    reordered: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for module in modules:
            weight = module.weight.data
            if id(module.weight) in reordered:
                continue
            try:
                packed = onednn_reorder(weight)
            except RuntimeError as exc:
                return f"oneDNN cannot reorder a {weight.dtype} weight on this CPU ({str(exc).splitlines()[0]})"
            why = _disagreement(weight, packed)
            if why is not None:
                return why
            reordered[id(module.weight)] = packed
    kept_bytes = 0
    for module in modules:
        key = id(module.weight)
        packed = reordered[key]
        # Per module (a tuned choice is shared by every weight of its shape),
        # keeping the BLAS forms the tuner chose, if any.
        module.matmul_choice = dataclasses.replace(module.matmul_choice or MatmulChoice(False), onednn_weight=packed)
        if key in shared:
            kept_bytes += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, nn.Module) and "weight" in module._parameters:
            # The parameter goes; the layer reads the reordered tensor (an
            # opaque layout a Parameter cannot hold).
            del module._parameters["weight"]
            setattr(module, "weight", packed)
    logger.info(
        "CPU weights reordered for oneDNN in %.2f s (%d weights; %.0f MiB of plain weights kept for tied embeddings)",
        time.perf_counter() - started, len(reordered), kept_bytes / 2**20,
    )
    return None
