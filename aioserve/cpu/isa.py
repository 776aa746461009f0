"""What this CPU can do, from /proc/cpuinfo: read in one place for the
native kernels' cache key and build flags, the dtype choice and the matmul
tuner's cache.

`AIOSERVE_CPU_ISA=avx2` makes an AVX-512 machine answer as an AVX2-only one
would: no `avx512*` or `amx*` flag (so the dtype choice and the packing act
as there) and native kernels built without AVX-512 (their AVX2 code paths).
It is for checking those paths where no AVX2-only machine is at hand;
torch's own kernels follow `ATEN_CPU_CAPABILITY=avx2`,
`ONEDNN_MAX_CPU_ISA=AVX2` and `MKL_ENABLE_INSTRUCTIONS=AVX2`. The memory
system stays the machine's own, so speeds are only indicative.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

ISA_ENV = "AIOSERVE_CPU_ISA"
WIDER_THAN_AVX2 = ("avx512", "amx")  # flag prefixes an AVX2-only CPU lacks


def emulated_isa() -> str | None:
    """"avx2" when AIOSERVE_CPU_ISA asks for it; None for the CPU as it is."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if value in ("", "native"):
        return None
    if value != "avx2":
        raise ValueError(f"{ISA_ENV}={value!r}: expected 'avx2' or 'native'")
    return value


def native_isa_cflags() -> list[str]:
    """Compiler flags that narrow -march=native to the emulated ISA."""
    return ["-mno-avx512f"] if emulated_isa() == "avx2" else []  # -mno-avx512f drops every AVX-512 subset


@cache
def cpu_flags_line() -> str:
    """The first "flags" (x86) or "Features" (Arm) line, or the platform's
    processor name where there is no /proc/cpuinfo; without the flags an
    emulated ISA lacks."""
    line = _first_flags_line()
    if emulated_isa() == "avx2" and ":" in line:
        name, flags = line.split(":", 1)
        line = f"{name}: " + " ".join(f for f in flags.split() if not f.startswith(WIDER_THAN_AVX2))
    return line


def _first_flags_line() -> str:
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
