"""Greedy tokens straight from a packed half-precision LM head.

A greedy row needs only the argmax of its logits, yet the head wrote them
all, [rows, vocab] in float32, for the sampler to read once more: Qwen3-0.6B
at 64 rows writes 39 MB a step and scans it again. The native
`packed_linear_argmax` (native/gemm.cpp) keeps, as each block of columns
is computed, each row's first largest value as the head's float32 output
would hold it (rounded to the weights' half type, as that output is), then
merges the blocks in column order: row_max_argmax's answer on those logits,
bit for bit, ties and NaN included, without them.

Measured on a 2-core Emerald Rapids VM (AMX), Qwen3-0.6B's head [151936,
1024] bf16, interleaved: 64 rows 32.4 / 33.8 -> 28.9 / 32.3 ms (min of 6,
two runs), 16 rows 14.4 -> 13.4 ms, one row the same; the per-block argmax
costs about what the store did, so the gain is the sampler's second pass.
(Its first form, a scalar loop with a branch a column, was slower than
writing the logits: 31.0 against 23.7 ms at 64 rows.)

It serves where the float32 greedy screen (greedy_screen.py) does not: a
packed head of half width on one rank, for the steps whose every row is
greedy (`SamplingTensors.takes_raw_argmax`). A row whose largest logit is
not finite sends the step to the full logits, so the sampler's own handling
of such rows stays the only one.

Steps of 1 to 12 rows on AMX-INT8 (1-4 on AVX512-VNNI) first ask an int8 copy of the head
(int8_head_screen.py): the same tokens from half the bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch

from aioserve.cpu_engine.int8_head_screen import Int8HeadScreen

logger = logging.getLogger(__name__)


@dataclass
class HeadArgmax:
    kernels: ModuleType  # the native module
    weight: torch.Tensor  # the LM head's packed weight (shared, not copied)
    features: int  # N, the vocabulary
    int8: Int8HeadScreen | None = None  # asked first for steps of a few rows

    @classmethod
    def build(cls, lm_head: torch.nn.Module, kernels: ModuleType, int8_screen: bool = False) -> HeadArgmax | None:
        """For a packed half-width LM head; None where it is not one.
        `int8_screen`: with an int8 copy of a bf16 head where the CPU runs it
        (cpu/dispatch.py's choice)."""
        choice = getattr(lm_head, "matmul_choice", None)
        weight = cast(torch.Tensor, lm_head.weight).data
        if choice is None or choice.packed_features is None or weight.dtype not in (torch.bfloat16, torch.float16):
            return None
        logger.info("greedy rows take the LM head's argmax as it computes (no logits written)")
        features = choice.packed_features
        int8 = Int8HeadScreen.build(weight, features, kernels) if int8_screen else None
        return cls(kernels, weight, features, int8)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each row of `hidden` [S, K], or None when some
        row's largest logit is not finite (the full logits then go to the sampler)."""
        if self.int8 is not None:
            tokens = self.int8.argmax(hidden)
            if tokens is not None:
                return tokens
        maxes, tokens = self.kernels.packed_linear_argmax(hidden, self.weight, None, self.features)
        return tokens if bool(maxes.isfinite().all()) else None
