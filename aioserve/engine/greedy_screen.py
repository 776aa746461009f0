"""Greedy tokens from a float16 copy of a float32 LM head, exactly.

A float32 checkpoint's LM head is the biggest single read of a decode step
(tiny-llama: [32000, 288], 37 MB a token, as long as its six layers), and a
greedy row only needs the argmax of its logits. The native
`screened_argmax` (native/greedy_screen.cpp, which gives the proof) computes
the logits from a float16 copy of the weight, bounds how far each can be
from the float32 one, and recomputes exactly, as the packed matmul does,
only the few columns that could still win. So the tokens are the ones the
full logits give, bit for bit; a row the bound cannot settle (not finite,
or too many close columns) makes the caller compute the full logits.

It serves the steps the sampler's own greedy fast path does
(`SamplingTensors.takes_raw_argmax`), on one rank (a sharded LM head would
need a cross-rank argmax). Measured on a 2-core EPYC, tiny-llama's decode
step: batch 1 1.6-1.7 -> 1.0-1.1 ms, batch 4 2.2 -> 1.6-2.0 ms, batch 8 to
32 unchanged (the head is compute-bound there).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

UNIT_ROUNDOFF = 2.0**-24  # float32's
SAFETY = 1 + 2.0**-10  # covers the slack's float64 arithmetic and its rounding to float32
ROWS_PER_SLACK_CHUNK = 4096  # weight rows converted at a time: float64 copies of a big head stay small


@dataclass
class GreedyScreen:
    kernels: object  # the native module
    screen: torch.Tensor  # the weight in float16, packed like `exact`
    exact: torch.Tensor  # the LM head's own packed float32 weight (shared, not copied)
    slack: torch.Tensor  # [N] float32, rounded up: |E_j - A_j| <= ||x|| slack_j (see greedy_screen.cpp)
    features: int  # N, the vocabulary

    @classmethod
    def build(cls, lm_head: torch.nn.Module, kernels: object, tp_size: int) -> GreedyScreen | None:
        """The screen for a packed float32 LM head; None where it does not apply."""
        choice = getattr(lm_head, "matmul_choice", None)
        weight = lm_head.weight.data
        if (
            tp_size != 1
            or choice is None
            or choice.packed_features is None
            or weight.dim() != 3
            or weight.dtype != torch.float32
            or not kernels.gemm_fuses_multiply_add()  # type: ignore[attr-defined]
        ):
            return None
        started = time.perf_counter()
        features = choice.packed_features
        rows = weight.permute(0, 2, 1).reshape(-1, weight.shape[1])[:features]  # [N, K], a view of the pack
        half = rows.to(torch.float16)
        if not half.isfinite().all():
            logger.info("greedy screen off: the LM head has weights beyond float16's range")
            return None
        slack = _slack(rows, half)
        screen = kernels.pack_linear_weight(half)  # type: ignore[attr-defined]
        logger.info(
            "greedy rows screen a float16 copy of the LM head (%.0f MiB, made in %.2f s)",
            screen.nbytes / 2**20, time.perf_counter() - started,
        )
        return cls(kernels, screen, weight, slack, features)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each row of float32 `hidden` [S, K], or None
        when some row needs the full logits."""
        if hidden.dtype != torch.float32:
            return None
        tokens, ok = self.kernels.screened_argmax(hidden, self.screen, self.slack, self.exact, self.features)  # type: ignore[attr-defined]
        return tokens if bool(ok.all()) else None


def _slack(rows: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """Per column j: ||e_j|| + gamma_K (||w_j|| + ||fp16(w_j)||), computed in
    float64 and rounded up to float32."""
    k = rows.shape[1]
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    out = torch.empty(rows.shape[0], dtype=torch.float64)
    for start in range(0, rows.shape[0], ROWS_PER_SLACK_CHUNK):
        w = rows[start : start + ROWS_PER_SLACK_CHUNK].double()
        h = half[start : start + ROWS_PER_SLACK_CHUNK].double()
        out[start : start + len(w)] = (w - h).norm(dim=1) + gamma * (w.norm(dim=1) + h.norm(dim=1))
    return (out * SAFETY).float()
