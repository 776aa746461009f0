"""The C++ kernels of native/, built on this machine and cached.

Each kernel has a pure-torch twin that is used when the build is not
possible (no compiler, no ninja, a package installed without native/, or
AIOSERVE_NATIVE=0) and while a background build is still running;
tests/test_native.py checks that both agree.

A cold build takes about 15 s on 2 idle cores (BUILD_S): plain C++ with no
torch header, compiled by the system compiler (ninja, native_build.py) into
a shared library that native_lib.py loads with ctypes. With torch's
extension headers each of the six files took ~50 s of CPU, and a build 4-11
minutes. `aioserve serve` builds (or loads from the cache) before it
listens, saying so on the console (`build_with_progress`); `aioserve
build-kernels` does it ahead of time; and `cpu_kernels(wait=False)` answers
None and starts the build in a background thread (the torch twins serve
meanwhile; later calls get the module once it is ready). The build runs in
its own session (native_build.py): no process of a build outlives it. A
build is cached under a key of everything the binary depends on (the
source, the compiler, the flags and this CPU's instruction set; not torch
or Python, whose headers it does not use), so two checkouts or two
environments on one machine share a build when they can and never evict
each other's. Builds of one key are serialized with an advisory file lock,
which the kernel releases when its holders die: a start killed mid-build
leaves nothing that makes the next one wait.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TextIO

from aioserve.cpu.isa import cpu_flags_line, native_isa_cflags

logger = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"
# One library from every source here; each exports its own C functions.
SOURCES = sorted(NATIVE_DIR.glob("*.cpp"))
HEADERS = sorted(NATIVE_DIR.glob("*.h"))
# Built on the machine that runs it, so native instructions are safe; the
# CPU's flags are part of the cache key in case the cache is shared.
# -fopenmp, not only -fopenmp-simd: parallel.h's `omp parallel` is compiled
# here; without it every kernel ran on one thread. The library links
# libgomp.so.1, the name torch's wheel loads its OpenMP runtime under, so the
# process keeps one runtime (one thread pool).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17", *native_isa_cflags()]
LDFLAGS = ["-fopenmp"]
# A cold build measured on 2 idle cores (AMD EPYC, AVX2): the estimate
# printed before this machine's own first build is known.
BUILD_S = 15.0


def cache_root() -> Path:
    configured = os.environ.get("AIOSERVE_NATIVE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "aioserve" / "native"


def sources_bytes() -> bytes:
    """Every source's and header's name and text: what the build's key depends on."""
    return b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in SOURCES + HEADERS)


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def build_key(source: bytes) -> str:
    # Not torch's or Python's version: the library uses neither's headers or ABI.
    parts = [source, compiler().encode(), " ".join(CFLAGS + LDFLAGS).encode(), platform.machine().encode(),
             cpu_flags_line().encode()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part + b"\0")
    return digest.hexdigest()[:16]


def _import(path: Path) -> ModuleType:
    """The kernels' Python module (native_kernels) over the library at `path`."""
    from aioserve.cpu import native_kernels, native_lib

    native_lib.load(path)
    return native_kernels


class _BuildLock:
    """An exclusive flock on a file in the build folder, released by the
    kernel if this process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> "_BuildLock":
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _locate() -> tuple[str, Path, Path]:
    """The library's file name, build folder and path for this source and machine."""
    key = build_key(sources_bytes())
    name = f"aioserve_cpu_kernels_{key}.so"
    folder = cache_root() / key
    return name, folder, folder / name


def load_cached() -> ModuleType | None:
    """The kernels' module if this machine built it before (fast: no compiler)."""
    _, _, built = _locate()
    return _import(built) if built.exists() else None


def _seconds_file() -> Path:
    return cache_root() / "last-build-seconds"


def last_build_seconds() -> float | None:
    """How long the last build on this machine (this cache) took, if known."""
    try:
        return float(_seconds_file().read_text())
    except (OSError, ValueError):
        return None


def load_or_build(on_wait: Callable[[float], None] | None = None) -> ModuleType:
    """The kernels' module: loaded from the cache, or built into it first
    (on_wait(elapsed_s) is called about every second while it builds)."""
    from aioserve.cpu.native_build import BuildRequest, build_in_own_session, write_ninja_file

    name, folder, built = _locate()
    if built.exists():
        try:
            return _import(built)
        except Exception:  # being written by another process, or corrupt: settled under the lock
            pass
    folder.mkdir(parents=True, exist_ok=True)
    with _BuildLock(folder / "aioserve-build.lock") as lock:
        if built.exists():  # another process built it while we waited, or a truncated one
            try:
                return _import(built)
            except Exception as exc:
                logger.warning("cached native kernels at %s failed to load (%s); rebuilding", built, exc)
                built.unlink()
        logger.info("building native CPU kernels into %s", folder)
        started = time.monotonic()
        write_ninja_file(folder, SOURCES, name, compiler(), CFLAGS, LDFLAGS)
        build_in_own_session(BuildRequest(str(folder), jobs=os.cpu_count() or 1), lock.fd, on_wait)
        _seconds_file().write_text(f"{time.monotonic() - started:.1f}\n")
        return _import(built)


class _Kernels:
    """The process's one build attempt, possibly running in the background."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self.module: ModuleType | None = None
        self.failure: str | None = None  # why there are none, when a build failed

    def _run(self, on_wait: Callable[[float], None] | None) -> None:
        try:
            self.module = load_or_build(on_wait)
            logger.info("native CPU kernels ready")
        except Exception as exc:  # no compiler / ninja / headers
            self.failure = str(exc).splitlines()[0]
            logger.warning("native CPU kernels unavailable (%s); using the torch fallbacks", exc)
        finally:
            self._done.set()

    def get(self, wait: bool, on_build: Callable[[], Callable[[float], None]] | None = None) -> ModuleType | None:
        if self._done.is_set():
            return self.module
        if not enabled():
            return None
        with self._lock:
            if self._thread is None and not self._done.is_set():
                try:
                    self.module = load_cached()
                except Exception:  # a corrupt binary: the build thread replaces it
                    self.module = None
                if self.module is not None:
                    self._done.set()
                    return self.module
                on_wait = on_build() if on_build is not None else None
                self._thread = threading.Thread(target=self._run, args=(on_wait,), name="aioserve-native-build", daemon=True)
                self._thread.start()
                if not wait:
                    logger.info("native CPU kernels are being built in the background; torch fallbacks serve meanwhile")
        if wait:
            self._done.wait()
        return self.module


_kernels = _Kernels()


def enabled() -> bool:
    return os.environ.get("AIOSERVE_NATIVE", "1") != "0" and bool(SOURCES)


def build_failure() -> str | None:
    """Why there are no kernels when their build failed (the error's first
    line, naming the build log), else None."""
    return _kernels.failure


def cpu_kernels(wait: bool = True) -> ModuleType | None:
    """The compiled CPU kernels, or None (the callers fall back to torch ops).
    With wait=False, None while a build runs (started by this call if needed)."""
    return _kernels.get(wait)


class _Progress:
    """Console lines while a build runs: one when it starts (with how long the
    last one took here), one every `every_s` (the units done, once ninja has
    finished one, and an estimate of what is left), one at the end."""

    def __init__(self, stream: TextIO, every_s: float) -> None:
        self.stream = stream
        self.every_s = every_s
        self._next = every_s
        self._folder: Path | None = None
        self._last: float | None = None
        self._started = 0.0  # wall clock at start(): an older build's log says nothing of this one

    def say(self, line: str) -> None:
        print(f"aioserve: {line}", file=self.stream, flush=True)

    def start(self) -> Callable[[float], None]:
        self._last = last_build_seconds()
        took = f"the last build here took {self._last:.0f} s" if self._last else f"about {BUILD_S:.0f} s on 2 idle cores"
        self._folder = _locate()[1]
        self._started = time.time()
        self.say(f"building the native CPU kernels (once per environment; {took}) into {self._folder} ...")
        return self.tick

    def tick(self, elapsed: float) -> None:
        if elapsed < self._next:
            return
        self._next += self.every_s
        from aioserve.cpu.native_progress import seconds_left, units_done

        units = units_done(self._folder) if self._folder is not None and self._log_is_this_builds() else None
        if self._folder is None or units is None:
            self.say(f"still building the native CPU kernels: {elapsed:.0f} s")
            return
        left = seconds_left(self._folder, elapsed, self._last, BUILD_S, os.cpu_count() or 1)
        self.say(f"building native kernels: {units[0]}/{units[1]} units, {elapsed:.0f} s, ~{left or 1:.0f} s left")

    def _log_is_this_builds(self) -> bool:
        from aioserve.cpu.native_build import LOG_NAME

        assert self._folder is not None
        try:
            return (self._folder / LOG_NAME).stat().st_mtime >= self._started
        except OSError:
            return False


def build_with_progress(stream: TextIO | None = None, every_s: float = 5.0) -> ModuleType | None:
    """cpu_kernels(wait=True), saying on `stream` (stderr) when it must build,
    how it goes and how it ended. Returns None where they cannot be had."""
    if not enabled():
        return None
    progress = _Progress(stream or sys.stderr, every_s)
    started = time.monotonic()
    module = _kernels.get(wait=True, on_build=progress.start)
    seconds = time.monotonic() - started
    if module is None:
        progress.say(f"native CPU kernels unavailable ({_kernels.failure}); the torch fallbacks serve (slower)")
    elif seconds > 2.0:
        progress.say(f"native CPU kernels built in {seconds:.1f} s")
    return module


if __name__ == "__main__":  # `python -m aioserve.cpu.native`: build ahead of the first start
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if build_with_progress() is not None else 1)
