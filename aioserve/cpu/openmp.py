"""Keep the event loop's thread out of OpenMP.

torch runs its CPU ops on OpenMP (libgomp), which gives every thread that
starts a parallel region a team of worker threads of its own. The forward
thread needs its team; the event loop's thread never should: one small
op there (repeat_interleave over a plan's rows was one) left a second team
alive, and once libgomp's threads outnumber the cores its idle workers sleep
instead of spinning, so every parallel region of every step waits for a
wake-up (tiny-llama, 16 requests, 2 cores: 7 -> 13 ms a step).

`torch.set_num_threads(1)` cannot do this: besides the calling thread it sets
a process-wide count that any thread reads the first time a library's copy of
ATen's parallel_for runs on it, and the native kernels' copy first runs on
the forward thread during serving: it would have taken the count of 1 too.
So only this thread's OpenMP setting is changed, through the runtime torch
already loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _loaded_openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (GNU or Intel), or None."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line})
    if not paths:
        return None
    try:
        return ctypes.CDLL(paths[0])  # already loaded: the same library, not a second runtime
    except OSError:
        return None


@contextlib.contextmanager
def this_thread_single_threaded() -> Iterator[None]:
    """Run this thread's torch ops on one thread for the duration; other
    threads keep their own setting."""
    openmp = _loaded_openmp()
    if openmp is None:
        yield
        return
    # ATen sets the thread's count itself at its first parallel op: let it
    # do that now, so that it cannot undo the setting below later.
    previous = torch.get_num_threads()
    openmp.omp_set_num_threads(1)
    try:
        yield
    finally:
        openmp.omp_set_num_threads(previous)
