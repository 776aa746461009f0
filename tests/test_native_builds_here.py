"""Where this machine has a C++ compiler and ninja, the native kernels build.

Every native test skips when `cpu_kernels()` is None, which is right on a
machine without a compiler, and wrong after a compile error in native/: the
suite would then skip every kernel test and pass. This test tells the two
apart, and fails with the build log's end."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from aioserve.cpu import native


def has_toolchain() -> bool:
    ninja = shutil.which("ninja") or (Path(sys.executable).with_name("ninja").exists() and "beside python")
    return bool(shutil.which(native.compiler()) and ninja)


@pytest.mark.skipif(not has_toolchain(), reason="no C++ compiler or ninja here: the torch twins serve")
@pytest.mark.skipif(not native.enabled(), reason="the native kernels are turned off (AIOSERVE_NATIVE=0)")
def test_the_native_kernels_build_where_a_compiler_is() -> None:
    kernels = native.cpu_kernels(wait=True)
    assert kernels is not None, f"the native kernels failed to build: {native.build_failure()}"
