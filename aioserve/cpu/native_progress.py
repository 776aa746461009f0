"""How far a running build of the native kernels is, and how long it has
left: from ninja's own records, so the estimate rests on measured numbers.

ninja prints "[finished/total] command" as each command ends (NINJA_STATUS,
native_build.py), into the build's log, and appends each finished output's
start and end (ms) to the build folder's .ninja_log. The units differ a lot
(gemm.cpp takes ~5x module.cpp), so each unit is weighed by how long it took
in the last complete build under the same cache root, where there is one,
else by MEASURED_SECONDS, and the weights are scaled by this build's own
pace so far.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from aioserve.cpu.native_build import LOG_NAME

logger = logging.getLogger(__name__)

_STATUS = re.compile(rb"^\[(\d+)/(\d+)\] ", re.MULTILINE)
LINK = "(link)"  # the library's output, whose name carries the build's key
# Each unit's compile (CPU seconds, -O3 -march=native, g++ 12) on an idle
# 2-core AMD EPYC (AVX2), 2026-11-26: the weights before this machine has
# built once.
MEASURED_SECONDS = {"gemm.o": 7.4, "attention.o": 5.0, "elementwise.o": 4.5, "decoder.o": 2.0,
                    "greedy_screen.o": 2.0, "module.o": 1.6, LINK: 0.3}


def units_done(folder: Path) -> tuple[int, int] | None:
    """(finished, total) commands of the running build, from ninja's status
    lines in its log; None before the first one finished."""
    try:
        found = _STATUS.findall((folder / LOG_NAME).read_bytes())
    except OSError:
        return None
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def unit_times(ninja_log: Path) -> dict[str, tuple[float, float]]:
    """Each output's command's start and end (seconds into its build) in a
    .ninja_log (v5: start ms, end ms, mtime, output, hash)."""
    times: dict[str, tuple[float, float]] = {}
    try:
        lines = ninja_log.read_text().splitlines()
    except OSError:
        return times
    for line in lines:
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 4 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        times[LINK if fields[3].endswith(".so") else fields[3]] = (int(fields[0]) / 1000, int(fields[1]) / 1000)
    return times


def unit_seconds(ninja_log: Path) -> dict[str, float]:
    """Each output's command's seconds in a .ninja_log."""
    return {name: end - start for name, (start, end) in unit_times(ninja_log).items()}


def _last_complete(folder: Path) -> dict[str, float]:
    """unit_seconds of the newest other build under folder's cache root that linked its library."""
    logs = sorted(
        (log for log in folder.parent.glob("*/.ninja_log") if log.parent != folder),
        key=lambda log: log.stat().st_mtime, reverse=True,
    )
    for log in logs:
        seconds = unit_seconds(log)
        if LINK in seconds:
            return seconds
    return {}


def seconds_left(folder: Path, elapsed: float, last_total: float | None, default_total: float,
                 jobs: int) -> float | None:
    """Seconds the build in `folder` has left, or None before ninja finished
    a unit. The units not finished yet, each weighed (seconds of the last
    complete build, else MEASURED_SECONDS) and scaled by how much slower
    this build's finished units ran than their weights said (a busy
    machine), less what the ones running have done already, `jobs` at a
    time; before any unit finished, the last build's length (else
    `default_total`) less the time spent."""
    if units_done(folder) is None:
        return None
    weights = _last_complete(folder) or MEASURED_SECONDS
    times = unit_times(folder / ".ninja_log")
    finished = {name: end - start for name, (start, end) in times.items() if name in weights}
    if not finished:
        return max(1.0, (last_total or default_total) - elapsed)
    slowdown = sum(finished.values()) / max(sum(weights[name] for name in finished), 1e-9)
    remaining = [weights[name] * slowdown for name in weights if name not in finished]
    if not remaining:
        return 1.0
    # ninja starts a unit whenever one ends: the ones running now started at
    # the latest ends (or at 0, in the first `jobs` slots).
    running = min(jobs, len(remaining))
    starts = sorted([0.0] * jobs + [end for _, end in times.values()])[-running:]
    done_meanwhile = sum(max(0.0, elapsed - start) for start in starts)
    return max(1.0, (sum(remaining) - done_meanwhile) / running)
