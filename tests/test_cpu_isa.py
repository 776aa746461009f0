"""AIOSERVE_CPU_ISA=avx2: an AVX-512 machine answers as an AVX2-only one,
so the AVX2 code paths of the native kernels can be checked on it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioserve.cpu import isa as cpu_info

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_flags() -> Iterator[None]:
    cpu_info.cpu_flags_line.cache_clear()
    yield
    cpu_info.cpu_flags_line.cache_clear()


def test_avx2_emulation_hides_wider_flags(monkeypatch: pytest.MonkeyPatch, fresh_flags: None) -> None:
    real = cpu_info.cpu_flags()
    monkeypatch.setenv(cpu_info.ISA_ENV, "avx2")
    cpu_info.cpu_flags_line.cache_clear()
    emulated = cpu_info.cpu_flags()
    assert not any(flag.startswith(("avx512", "amx")) for flag in emulated)
    assert emulated == {flag for flag in real if not flag.startswith(("avx512", "amx"))}
    assert cpu_info.native_isa_cflags() == ["-mno-avx512f"]
    monkeypatch.setenv(cpu_info.ISA_ENV, "native")
    assert cpu_info.native_isa_cflags() == []
    monkeypatch.setenv(cpu_info.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="AIOSERVE_CPU_ISA"):
        cpu_info.emulated_isa()


@pytest.mark.slow  # builds the kernels a second time (~2 min on 2 cores)
@pytest.mark.skipif("avx2" not in cpu_info.cpu_flags(), reason="the CPU has no AVX2")
def test_the_native_kernels_built_for_avx2_pass_their_tests() -> None:
    env = {**os.environ, cpu_info.ISA_ENV: "avx2"}
    probe = "import aioserve.cpu.native as n; k = n.cpu_kernels(wait=True); print(k.gemm_block_width())"
    width = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert width.stdout.split()[-1] == "16", width.stderr[-2000:]  # two 8-float AVX2 vectors a block
    tests = ["test_native.py", "test_native_gemm.py", "test_native_elementwise.py", "test_native_decoder.py",
             "test_greedy_screen.py", "test_cpu_half.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(f"tests/{t}" for t in tests)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-4000:]
