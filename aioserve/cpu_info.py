"""What this CPU can do, from /proc/cpuinfo: read in one place for the
native kernels' cache key, the dtype choice and the matmul tuner's cache."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path


@cache
def cpu_flags_line() -> str:
    """The first "flags" (x86) or "Features" (Arm) line, or the platform's
    processor name where there is no /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags, e.g. {"avx2", "avx512_bf16", ...}."""
    line = cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()
