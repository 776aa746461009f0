"""The GPU proof's staging (tools/gpu/stage.py) and gpu_check.sh's wiring,
on CPU: the size check, the calls it prints, and a dry run of every phase
a session pastes, which fails on a step whose function, script or program
does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import stage  # noqa: E402  (tools/gpu is no package)


def test_size_check_keeps_headroom_under_the_device_cap() -> None:
    assert stage.size_problem(40.0) is None
    assert stage.size_problem(stage.DEVICE_LIMIT_MIB - stage.HEADROOM_MIB) is None
    problem = stage.size_problem(stage.DEVICE_LIMIT_MIB - stage.HEADROOM_MIB + 0.5)
    assert problem is not None and f"{stage.DEVICE_LIMIT_MIB} MiB" in problem


def test_the_tree_alone_leaves_room_for_the_bundle() -> None:
    """Tracked files take a few MiB; the bundle (~28) and models (~14) need the rest."""
    tracked = sum(p.stat().st_size for p in stage.travelling_files(REPO) if p.exists()
                  and not any(part in stage.CARRY for part in p.relative_to(REPO).parts)) / 2**20
    assert tracked < 16


def test_the_printed_calls_fit_the_device_tool() -> None:
    calls = stage.run_calls()
    assert list(calls) == ["proof", "figures"]
    for phase, call in calls.items():
        assert call.command.endswith(f"bash benchmarks/gpu_check.sh {phase}")
        budget = int(call.command.split("GPU_CHECK_BUDGET=")[1].split()[0])
        assert budget + 30 <= call.timeout_s <= 600  # the script ends before the call is cut
        assert len(call.command) <= 2000 and len(call.carry) <= 8
    assert calls["proof"].timeout_s <= 8 * 60 + 60  # a fresh machine's call: ~8 minutes
    for carried in stage.CARRY:  # carried, never committed
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{carried}/a.whl"], cwd=REPO)  # may not exist yet
        assert ignored.returncode == 0, f"{carried} is not git-ignored"


@pytest.mark.parametrize("phase", stage.DRY_PHASES)
def test_every_phase_is_wired(phase: str) -> None:
    code, steps = stage.dry_run(phase)
    assert code == 0, steps
    names = [line.split()[1] for line in steps.splitlines()]
    assert names and all(line.split()[2] == "dry" for line in steps.splitlines())
    if phase == "proof":  # correctness before figures
        assert names[:5] == ["install", "models", "versions", "jit", "pytest-gpu"]
        assert names.index("pytest-gpu") < names.index("offline-qwen3-graphs-overlap")


def test_a_dry_run_fails_on_a_missing_script(tmp_path: Path) -> None:
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    broken = tmp_path / "gpu_check.sh"
    broken.write_text(script.replace("tools/gpu/isolated_tests.py", "tools/gpu/no_such_runner.py"))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(broken), "proof"], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert "pytest-gpu" in (tmp_path / "out" / "steps.txt").read_text().split("UNWIRED")[0].splitlines()[-1]
