"""Whether the small per-layer ops run as native/elementwise.cpp's kernels.

A small model's CPU decode step is bound by per-op overhead, so on CPU,
once native/ has built, RMSNorm, RoPE, SwiGLU, the KV store and greedy
sampling each run as one fused kernel. Off CPU, while the build runs, with
AIOSERVE_NATIVE=0 or AIOSERVE_NATIVE_ELEMENTWISE=0 (or `ENABLED = False`,
read at every call), their torch twins serve.
"""

from __future__ import annotations

import os
from types import ModuleType

from aioserve.cpu.native import cpu_kernels

ENABLED = os.environ.get("AIOSERVE_NATIVE_ELEMENTWISE", "1") != "0"


def elementwise_kernels() -> ModuleType | None:
    """The native kernels, or None for the torch twins. For CPU tensors only:
    callers check that first, which also keeps a GPU run from building them."""
    return cpu_kernels(wait=False) if ENABLED else None
