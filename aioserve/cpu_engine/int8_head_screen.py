"""Greedy tokens from an int8 copy of a bf16 LM head, exactly (AMX-INT8).

A single-stream decode step is bound by reading the weights, and the LM head
is a quarter of them (Qwen3-0.6B: 311 MB of 1.19 GB). The native
`int8_screened_argmax` (native/int8_head_screen.cpp, which gives the proof)
reads an int8 copy of the head (one scale per column, made at load by
`int8_quantize_head`) through AMX-INT8 tiles, bounds how far each column's
bf16 logit can be from its screened value, and hands the few 32-column
blocks that could still hold the token to packed_linear_argmax itself: the
token is the one the bf16 head gives, bit for bit, ties and all.

It serves steps of 1 to SERVED_ROWS greedy rows
(`SamplingTensors.takes_raw_argmax`), where the head's bytes set its time;
more rows go to the bf16 head (head_argmax.py). Measured on a 2-core
Emerald Rapids VM, Qwen3-0.6B's head [151936, 1024] at random weights,
bf16 head -> screen, alternated, min (median) of 12: 1 row 11.5 (13.8) ->
6.6 (7.6) ms, 8 rows 12.2 (15.5) -> 8.7 (9.5), 12 rows 12.8 (13.7) -> 10.7
(11.3), 16 rows 13.7 (14.2) -> 13.1 (13.8): past 12 rows the blocks kept
for every row (each row keeps its own few) and the second A tile take back
what the bytes save.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import ModuleType

import torch

from aioserve.cpu.native_gemm import INT8_SCREEN_MAX_ROWS, Int8HeadCopy

logger = logging.getLogger(__name__)

SERVED_ROWS = 12  # the most rows a step may have for the screen to pay (measured above)
assert SERVED_ROWS <= INT8_SCREEN_MAX_ROWS
# Blocks computed again past which the screen gives up and the full head runs
# (rows whose bound cannot separate their top columns): an eighth of the head.
KEPT_FRACTION = 8
MIN_KEPT = 8  # a small head (a test model's) may keep this many whatever its size


@dataclass
class Int8HeadScreen:
    kernels: ModuleType  # the native module
    copy: Int8HeadCopy  # the int8 copy and its bound's constants
    exact: torch.Tensor  # the LM head's packed bf16 weight (shared, not copied)
    features: int  # N, the vocabulary

    @classmethod
    def build(cls, exact: torch.Tensor, features: int, kernels: ModuleType) -> Int8HeadScreen | None:
        """For a bf16 head packed in k-pairs [blocks, K / 2, 32, 2]; None
        where the screen does not run (no AMX-INT8 tiles in use, a K that is
        not a multiple of 64, weights that are not finite)."""
        if (
            exact.dtype != torch.bfloat16
            or exact.dim() != 4
            or exact.shape[2] != 32
            or (2 * exact.shape[1]) % 64
            or not kernels.int8_screen_ready()
        ):
            return None
        started = time.perf_counter()
        copy = kernels.int8_quantize_head(exact, features)
        if copy is None:
            logger.info("int8 head screen off: the LM head has weights that are not finite")
            return None
        logger.info(
            "greedy steps of 1-%d rows screen an int8 copy of the LM head (%.0f MiB, made in %.2f s)",
            SERVED_ROWS, copy.screen.nbytes / 2**20, time.perf_counter() - started,
        )
        return cls(kernels, copy, exact, features)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each row of bf16 `hidden` [S, K], or None when
        the screen does not take the step or settle some row (the caller
        runs the head)."""
        if hidden.dtype != torch.bfloat16 or not 1 <= hidden.shape[0] <= SERVED_ROWS:
            return None
        copy = self.copy
        tokens, ok = self.kernels.int8_screened_argmax(
            hidden, copy.screen, copy.scales, copy.slack, copy.norms, self.exact, self.features,
            max(MIN_KEPT, self.exact.shape[0] // KEPT_FRACTION),
        )
        return tokens if bool(ok.all()) else None
