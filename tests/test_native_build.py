"""Building the native kernels: a start killed mid-build does not make the
next one hang, builds are cached by what they depend on, and a server does
not wait for a build (the torch twins serve meanwhile)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aioserve.cpu import native

pytestmark = pytest.mark.skipif(
    native.cpu_kernels() is None, reason="native kernels cannot be built here (no compiler or ninja)"
)

BUILD = "import aioserve.cpu.native as n, sys; sys.exit(0 if n.cpu_kernels(wait=True) is not None else 1)"


def start_build(cache: Path) -> subprocess.Popen:
    env = {**os.environ, "AIOSERVE_NATIVE_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_a_build_killed_midway_does_not_block_the_next(tmp_path: Path) -> None:
    first = start_build(tmp_path)
    deadline = time.monotonic() + 120
    # Wait until the compiler is at work (ninja's file and torch's lock are there).
    while not list(tmp_path.glob("*/build.ninja")):
        assert first.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.1)
    time.sleep(1.0)
    first.kill()
    first.wait()
    (folder,) = tmp_path.iterdir()
    assert not list(folder.glob("*.so")), "the killed build finished anyway; kill it earlier"
    (folder / "lock").touch()  # what torch's own lock looks like when its holder died
    second = start_build(tmp_path)
    try:
        assert second.wait(timeout=300) == 0, second.stderr.read().decode()[-2000:] if second.stderr else ""
    except subprocess.TimeoutExpired:
        second.kill()
        pytest.fail("the start after a killed build hung")
    # A third start loads the cached binary without building: fast.
    started = time.monotonic()
    third = start_build(tmp_path)
    assert third.wait(timeout=60) == 0
    assert time.monotonic() - started < 15


def test_the_cache_key_follows_the_source_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    source = native.sources_bytes()
    key = native.build_key(source)
    assert native.build_key(source) == key  # stable
    assert native.build_key(source + b"// changed\n") != key
    monkeypatch.setattr(native, "CFLAGS", native.CFLAGS + ["-DX"])
    assert native.build_key(source) != key


def test_without_a_cached_build_the_caller_does_not_wait(tmp_path: Path) -> None:
    code = (
        "import time, aioserve.cpu.native as n; t = time.monotonic(); m = n.cpu_kernels(wait=False); "
        "print(m is None, time.monotonic() - t)"
    )
    env = {**os.environ, "AIOSERVE_NATIVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    waited_none, seconds = out.stdout.split()
    assert waited_none == "True" and float(seconds) < 5
