"""Where this machine has a C++ compiler and ninja, the native kernels build.

Every native test skips when `cpu_kernels()` is None, which is right on a
machine without a compiler, and wrong after a compile error in native/: the
suite would then skip every kernel test and pass. This test tells the two
apart, and fails naming the build log."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aioserve.cpu import native
from aioserve.cpu.native_build import ninja_path


def has_toolchain() -> bool:
    """The compiler and the ninja a build would run are there."""
    return shutil.which(native.compiler()) is not None and Path(ninja_path()).exists()


@pytest.mark.skipif(not has_toolchain(), reason="no C++ compiler or ninja here: the torch twins serve")
@pytest.mark.skipif(not native.enabled(), reason="the native kernels are turned off (AIOSERVE_NATIVE=0)")
def test_the_native_kernels_build_where_a_compiler_is() -> None:
    kernels = native.cpu_kernels(wait=True)
    assert kernels is not None, f"the native kernels failed to build: {native.build_failure()}"
