"""A pytest plugin for tools/gpu/isolated_tests.py: one JSON line per
test phase that decides its outcome, into $TEST_LINES_FILE, written as the
test finishes (so a process killed later still leaves what it did). The
reader keeps a test's last line: a teardown error overrides a pass."""

from __future__ import annotations

import json
import os

import pytest

_seconds: dict[str, float] = {}


def _outcome(report: pytest.TestReport) -> str | None:
    if report.when == "call":
        return report.outcome
    if report.failed:
        return "error"  # setup or teardown failed
    if report.when == "setup" and report.skipped:
        return "skipped"
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    outcome = _outcome(report)
    if outcome is not None:
        record = {"nodeid": report.nodeid, "outcome": outcome, "seconds": round(_seconds[report.nodeid], 2)}
        if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: why")
            record["why"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        with open(os.environ["TEST_LINES_FILE"], "a") as out:
            out.write(json.dumps(record) + "\n")
