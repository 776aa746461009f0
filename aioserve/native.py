"""The C++ kernels of native/, JIT-built on first use with
torch.utils.cpp_extension and cached (TORCH_EXTENSIONS_DIR).

Each kernel has a pure-torch twin that is used when the build is not
possible (no compiler, no ninja, a package installed without native/, or
AIOSERVE_NATIVE=0); tests/test_native.py checks that both agree.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).resolve().parents[1] / "native"


@functools.lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    """The compiled CPU kernels, or None (the callers fall back to torch ops)."""
    source = NATIVE_DIR / "cpu_kernels.cpp"
    if os.environ.get("AIOSERVE_NATIVE", "1") == "0" or not source.exists():
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="aioserve_cpu_kernels",
            sources=[str(source)],
            # Built on the machine that runs it, so native instructions are safe.
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            verbose=False,
        )
    except Exception as exc:  # no compiler / ninja / headers
        logger.warning("native CPU kernels unavailable (%s); using the torch fallbacks", exc)
        return None
    logger.info("native CPU kernels loaded from %s", source)
    return module
