"""Greedy tokens from an int8 copy of a bf16 LM head, exactly (AMX-INT8, or AVX512-VNNI).

A single-stream decode step is bound by reading the weights, and the LM head
is a quarter of them (Qwen3-0.6B: 311 MB of 1.19 GB). The native
`int8_screened_argmax` (native/int8_head_screen.cpp, which gives the proof)
reads an int8 copy of the head (one scale per column, made at load by
`int8_quantize_head`) through AMX-INT8 tiles, bounds how far each column's
bf16 logit can be from its screened value, and hands the few 32-column
blocks that could still hold the token to packed_linear_argmax itself: the
token is the one the bf16 head gives, bit for bit, ties and all.

Its sums run on the AMX-INT8 tiles where the bf16 head runs on AMX, else
on AVX512-VNNI dot products for 1-4 rows (AMD Zen 4, Ice Lake; and with
AIOSERVE_AMX=0). It serves steps of 1 to SERVED_ROWS greedy rows
(`SamplingTensors.takes_raw_argmax`), where the head's bytes set its time;
more rows go to the bf16 head (head_argmax.py). Measured on a 2-core
Emerald Rapids VM, Qwen3-0.6B's head [151936, 1024] at random weights,
bf16 head -> screen, alternated, min (median) of 12: 1 row 9.9 (10.2) ->
6.0 (6.1) ms, 8 rows 9.9 (10.5) -> 6.4 (6.9), 12 rows 10.5 (10.7) -> 8.0
(8.2), 16 rows 10.8 (11.4) -> 8.7 (9.1); Llama-3-8B's shape [128256,
4096]: 1 row 36 -> 21 ms, 4 rows 36 -> 24, 12 rows 36 -> 37. Past 12 rows
the blocks kept for every row (each row keeps its own few) and the second A
tile take back what the bytes save; the bound's slack grows as sqrt(K),
so a wide head keeps more.
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
# A step the screen gives back cost its int8 pass and then the whole bf16
# head: after one, the next `rest` steps go straight to the head, `rest`
# doubling with each miss in a row (up to MAX_REST) and back to 1 after a
# step it settles. (Random weights at K = 4096, 12 rows: ~2000 blocks of
# 4008 kept; a real model's confident rows keep a few.)
MAX_REST = 256


@dataclass
class Int8HeadScreen:
    kernels: ModuleType  # the native module
    copy: Int8HeadCopy  # the int8 copy and its bound's constants
    exact: torch.Tensor  # the LM head's packed bf16 weight (shared, not copied)
    features: int  # N, the vocabulary
    rest: int = 0  # steps left to go straight to the bf16 head
    backoff: int = 1  # the rest after the next miss

    @classmethod
    def build(cls, exact: torch.Tensor, features: int, kernels: ModuleType) -> Int8HeadScreen | None:
        """For a bf16 head packed in k-pairs [blocks, K / 2, 32, 2]; None
        where the screen does not run (neither AMX-INT8 tiles nor AVX512-VNNI,
        a K that is not a multiple of 64, weights that are not finite)."""
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
            min(SERVED_ROWS, kernels.int8_screen_rows()), copy.screen.nbytes / 2**20, time.perf_counter() - started,
        )
        return cls(kernels, copy, exact, features)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each row of bf16 `hidden` [S, K], or None when
        the screen does not take the step or settle some row (the caller
        runs the head)."""
        rows = hidden.shape[0]
        if hidden.dtype != torch.bfloat16 or not 1 <= rows <= min(SERVED_ROWS, self.kernels.int8_screen_rows()):
            return None
        if self.rest > 0:
            self.rest -= 1
            return None
        tokens, ok = self.kernels.int8_screened_argmax(
            hidden, self.copy, self.exact, self.features, max(MIN_KEPT, self.exact.shape[0] // KEPT_FRACTION)
        )
        if bool(ok.all()):
            self.backoff = 1
            return tokens
        self.rest, self.backoff = self.backoff, min(2 * self.backoff, MAX_REST)
        return None
