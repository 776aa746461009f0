"""Greedy tokens from a half-width copy of a float32 LM head, exactly.

A float32 checkpoint's LM head is the biggest single read of a decode step
(tiny-llama: [32000, 288], 37 MB a token, as long as its six layers), and a
greedy row only needs the argmax of its logits. The native
`screened_argmax` (native/greedy_screen.cpp, which gives the proof) computes
the logits from a half-width copy of the weight, bounds how far each can be
from the float32 one, and recomputes exactly, as the packed matmul does,
only the few columns that could still win. So the tokens are the ones the
full logits give, bit for bit; a row the bound cannot settle (not finite,
or too many close columns) makes the caller compute the full logits.

The copy is bfloat16 where the CPU has AVX512-BF16 (its dot-product
instruction does two multiply-adds at once, and past a few rows the head
is bound by them, not by its bytes), float16 elsewhere (a tighter bound,
one float32 multiply-add per weight).

It serves the steps the sampler's own greedy fast path does
(`SamplingTensors.takes_raw_argmax`), on one rank (a sharded LM head would
need a cross-rank argmax). Measured on a 2-core EPYC, tiny-llama's decode
step: batch 1 1.6-1.7 -> 1.0-1.1 ms, batch 4 2.2 -> 1.6-2.0 ms with the
float16 copy, which left batch 8 to 32 unchanged; the bf16 copy then took
the head at batch 16 from 2.0-2.5 to about 1 ms.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch

logger = logging.getLogger(__name__)

UNIT_ROUNDOFF = 2.0**-24  # float32's
SAFETY = 1 + 2.0**-10  # covers the slack's float64 arithmetic and its rounding to float32
ROWS_PER_SLACK_CHUNK = 4096  # weight rows converted at a time: float64 copies of a big head stay small


@dataclass
class GreedyScreen:
    kernels: ModuleType  # the native module
    screen: torch.Tensor  # the weight in float16 packed like `exact`, or in bf16 packed in k-pairs
    exact: torch.Tensor  # the LM head's own packed float32 weight (shared, not copied)
    slack: torch.Tensor  # [N] float32, rounded up (see greedy_screen.cpp)
    features: int  # N, the vocabulary
    screen_norms: torch.Tensor | None = None  # [N] float32 ||bf16 w_j||, rounded up: the bf16 copy's

    @property
    def max_rows(self) -> int | None:
        """The most rows a step may have for the screen to pay. The float16
        copy saves bytes, not multiply-adds: past FLOAT16_MAX_ROWS the head
        is bound by those, and the screen's scan and conversions only add
        (tiny-llama, batch 16: 4.5 ms a step against 4.2 without it; batch 8
        even). The bf16 copy halves the multiply-adds too: no limit."""
        return None if self.screen_norms is not None else FLOAT16_MAX_ROWS

    @classmethod
    def build(cls, lm_head: torch.nn.Module, kernels: ModuleType, copy_dtype: torch.dtype | None) -> GreedyScreen | None:
        """The screen for a packed float32 LM head; None where it does not
        apply. `copy_dtype`: bfloat16 or float16, as cpu/dispatch.py chose
        for this CPU (bf16 where the kernels dot bf16 pairs); None: no screen."""
        choice = getattr(lm_head, "matmul_choice", None)
        weight = cast(torch.Tensor, lm_head.weight).data
        if (
            copy_dtype is None
            or choice is None
            or choice.packed_features is None
            or weight.dim() != 3
            or weight.dtype != torch.float32
            or not kernels.gemm_fuses_multiply_add()
        ):
            return None
        started = time.perf_counter()
        features = choice.packed_features
        rows = weight.permute(0, 2, 1).reshape(-1, weight.shape[1])[:features]  # [N, K], a view of the pack
        if copy_dtype == torch.bfloat16:
            if not dots_bf16_pairs(kernels):
                raise ValueError("a bfloat16 screen needs kernels that dot bf16 pairs (AVX512-BF16)")
            if rows.shape[1] % 2:
                copy_dtype = torch.float16  # the pairs need an even K
        copy = screen_copy(rows, copy_dtype)
        if not copy.isfinite().all():
            logger.info("greedy screen off: the LM head has weights beyond %s's range", copy_dtype)
            return None
        slack, screen_norms = _bounds(rows, copy)
        screen = kernels.pack_linear_weight(copy)
        logger.info(
            "greedy rows screen a %s copy of the LM head (%.0f MiB, made in %.2f s)",
            str(copy_dtype).removeprefix("torch."), screen.nbytes / 2**20, time.perf_counter() - started,
        )
        return cls(kernels, screen, weight, slack, features, screen_norms)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each row of float32 `hidden` [S, K], or None
        when some row needs the full logits (or there are too many rows for
        the screen to pay)."""
        if hidden.dtype != torch.float32 or (self.max_rows is not None and hidden.shape[0] > self.max_rows):
            return None
        tokens, ok = self.kernels.screened_argmax(
            hidden, self.screen, self.slack, self.exact, self.features, self.screen_norms
        )
        return tokens if bool(ok.all()) else None


MIN_NORMAL = 2.0**-126  # float32's and bfloat16's smallest normal number
FLOAT16_MAX_ROWS = 8


def screen_copy(rows: torch.Tensor, copy_dtype: torch.dtype) -> torch.Tensor:
    """The weight rows [N, K] in the screen's dtype; a bf16 copy with its
    subnormals flushed to zero, as the dot instruction would flush them."""
    copy = rows.to(copy_dtype)
    if copy_dtype == torch.bfloat16:
        copy.masked_fill_(copy.abs() < MIN_NORMAL, 0)
    return copy


def dots_bf16_pairs(kernels: ModuleType) -> bool:
    """Whether the packed kernels pack bf16 weights in k-pairs for the
    dot-product instruction (AVX512-BF16)."""
    return kernels.pack_linear_weight(torch.zeros(1, 2, dtype=torch.bfloat16)).dim() == 4


def _bounds(rows: torch.Tensor, copy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-column constants of the bound (greedy_screen.cpp), computed in
    float64 and rounded up to float32. float16 copy: slack_j = ||e_j|| +
    gamma_K (||w_j|| + ||fp16(w_j)||), no norms. bf16 copy: slack_j = ||e_j||
    + gamma_K ||w_j||, and the norms ||w~_j||."""
    k = rows.shape[1]
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    bf16 = copy.dtype == torch.bfloat16
    slack = torch.empty(rows.shape[0], dtype=torch.float64)
    norms = torch.empty(rows.shape[0], dtype=torch.float64)
    for start in range(0, rows.shape[0], ROWS_PER_SLACK_CHUNK):
        w = rows[start : start + ROWS_PER_SLACK_CHUNK].double()
        h = copy[start : start + ROWS_PER_SLACK_CHUNK].double()
        h_norm = h.norm(dim=1)
        slack[start : start + len(w)] = (w - h).norm(dim=1) + gamma * (w.norm(dim=1) + (0 if bf16 else h_norm))
        norms[start : start + len(w)] = h_norm
    return (slack * SAFETY).float(), (norms * SAFETY).float() if bf16 else None
