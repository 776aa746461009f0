"""How far a running build of the native kernels is, and how long it has
left: from ninja's own records, so the estimate rests on measured numbers.

ninja prints "[finished/total] command" as each command ends (NINJA_STATUS,
native_build.py), into the build's log, and appends each finished output's
start and end (ms) to the build folder's .ninja_log. The units differ a lot
(gemm.cpp takes ~5x module.cpp), so each unit is weighed by how long it took
in the last complete build under the same cache root, where there is one,
else by MEASURED_SECONDS.
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


def unit_seconds(ninja_log: Path) -> dict[str, float]:
    """Each output's command's seconds in a .ninja_log (v5: start, end, mtime, output, hash)."""
    seconds: dict[str, float] = {}
    try:
        lines = ninja_log.read_text().splitlines()
    except OSError:
        return seconds
    for line in lines:
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 4 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        name = LINK if fields[3].endswith(".so") else fields[3]
        seconds[name] = (int(fields[1]) - int(fields[0])) / 1000
    return seconds


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


def seconds_left(folder: Path, elapsed: float, last_total: float | None, default_total: float) -> float | None:
    """Seconds the build in `folder` has left, or None before ninja finished
    a unit. Once a third of the work is done, by this build's own pace;
    before (or while nothing has), the last build's length (else
    `default_total`) less the time spent, unless that has run out."""
    units = units_done(folder)
    if units is None:
        return None
    done_units, total_units = units
    weights = _last_complete(folder) or MEASURED_SECONDS
    finished = set(unit_seconds(folder / ".ninja_log"))
    if total_units == len(weights) and finished <= set(weights):
        fraction = sum(s for name, s in weights.items() if name in finished) / max(sum(weights.values()), 1e-9)
    else:  # other sources than the weights know: every unit alike
        fraction = done_units / max(total_units, 1)
    prior = (last_total or default_total) - elapsed
    if fraction > 0 and (fraction >= 1 / 3 or prior < 1):
        return max(1.0, elapsed * (1 - fraction) / fraction)
    return max(1.0, prior)
