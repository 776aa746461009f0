"""Building the native kernels: a start killed mid-build takes its ninja and
compilers with it and does not make the next one hang, `aioserve
build-kernels` builds with progress lines, builds are cached by what they
depend on, and a background build does not hold its caller (the torch twins
serve meanwhile)."""

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


def build_kernels_command(cache: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "AIOSERVE_NATIVE_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "aioserve", "build-kernels"], env=env, capture_output=True, text=True, timeout=timeout
    )


def processes_touching(folder: Path) -> list[str]:
    """Processes whose command line or working folder names `folder`: a
    build's ninja (run in the build folder) and compilers (writing into it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if str(folder) in cmdline or cwd.startswith(str(folder)):
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.slow  # ~22 s: a real compiler killed and run again
def test_a_build_killed_midway_does_not_block_the_next(tmp_path: Path) -> None:
    first = start_build(tmp_path)
    deadline = time.monotonic() + 120
    # Wait until the compiler is at work (ninja's file and torch's lock are there).
    while not list(tmp_path.glob("*/build.ninja")):
        assert first.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.1)
    time.sleep(1.0)
    compilers = [p for p in processes_touching(tmp_path) if f"{first.pid}:" not in p]
    assert compilers, "no ninja or compiler seen at work"
    first.kill()
    first.wait()
    # Its ninja and compilers go with it (they ran in the build's own process group).
    deadline = time.monotonic() + 10
    while (left := processes_touching(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the killed build outlived it: {left}"
    (folder,) = tmp_path.iterdir()
    assert not list(folder.glob("*.so")), "the killed build finished anyway; kill it earlier"
    (folder / "lock").touch()  # what torch's own lock looks like when its holder died
    try:
        second = build_kernels_command(tmp_path, timeout=900)  # minutes on 2 busy cores; a hang is forever
    except subprocess.TimeoutExpired:
        pytest.fail("the start after a killed build hung")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "building the native CPU kernels" in second.stderr and "native CPU kernels built in" in second.stderr
    assert not processes_touching(tmp_path)
    # A third start loads the cached binary without building: fast, and silent about building.
    started = time.monotonic()
    third = build_kernels_command(tmp_path, timeout=60)
    assert third.returncode == 0 and "building" not in third.stderr, third.stderr
    assert "native CPU kernels ready" in third.stderr
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


def test_serve_builds_before_listening_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioserve import cli

    built: list[bool] = []
    monkeypatch.setattr(native, "build_with_progress", lambda: built.append(True))
    # setenv first: monkeypatch then restores the variable as it was (unset),
    # which the cli's own os.environ write below would otherwise outlive.
    monkeypatch.setenv("AIOSERVE_NATIVE", "1")
    monkeypatch.delenv("AIOSERVE_NATIVE")
    cli.prepare_native_kernels(cli.parse_serve_args(["--device", "cpu"]))
    assert built == [True]  # the default: built (or loaded) before run_server listens
    cli.prepare_native_kernels(cli.parse_serve_args(["--device", "cpu", "--native-kernels", "background"]))
    cli.prepare_native_kernels(cli.parse_serve_args(["--device", "cuda", "--native-kernels", "build"]))
    assert built == [True] and "AIOSERVE_NATIVE" not in os.environ  # left to the engine; not needed on CUDA
    cli.prepare_native_kernels(cli.parse_serve_args(["--native-kernels", "off"]))
    assert os.environ["AIOSERVE_NATIVE"] == "0" and built == [True]  # as AIOSERVE_NATIVE=0: never built


def test_progress_lines_say_what_the_build_does() -> None:
    import io

    stream = io.StringIO()
    progress = native._Progress(stream, every_s=10.0)
    tick = progress.start()
    for elapsed in (3.0, 10.5, 12.0, 21.0):
        tick(elapsed)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("aioserve: building the native CPU kernels (once per environment;")
    assert lines[1:] == ["aioserve: still building the native CPU kernels: 10 s",
                         "aioserve: still building the native CPU kernels: 21 s"]
