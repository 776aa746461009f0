"""The package type-checks: mypy, configured in pyproject.toml's [tool.mypy],
reports no error over aioserve/. It runs here so that the README's one test
command is also the type check CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error() -> None:
    # cwd=ROOT: mypy reads pyproject.toml from there and keeps its incremental
    # cache in ROOT/.mypy_cache (git-ignored), so a rerun takes seconds, not a minute.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-color-output"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"mypy found errors:\n{report}"
