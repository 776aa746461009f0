"""tools/gpu/isolated_tests.py, the GPU session's test runner, on CPU:
a test that poisons its process (as a sticky CUDA fault does) cannot turn
the tests after it into failures; a failure is rerun alone with
CUDA_LAUNCH_BLOCKING=1; a hung test is cut at its timeout and a dead
process named, with its stack dump and its server's log kept; every test
gets its own line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "isolated_tests.py"

SUITE = '''
import os, signal, time
import pytest

POISON = os.path.join(os.path.dirname(__file__), "poisoned-")

def test_a():
    pass

def test_b_faults():
    print("CUDA_LAUNCH_BLOCKING =", os.environ.get("CUDA_LAUNCH_BLOCKING"))
    open(POISON + str(os.getpid()), "w").close()  # every later test of this process now fails
    raise RuntimeError("CUDA error: misaligned address")

def test_c():
    assert not os.path.exists(POISON + str(os.getpid())), "a sticky error from an earlier test"

def test_d_hangs():
    import tempfile
    with open(os.path.join(tempfile.gettempdir(), f"aioserve-{os.getpid()}.log"), "w") as log:
        log.write("the server's side of the hang")  # as tools/server_process.py names a server's log
    time.sleep(120)

def test_e_skips():
    pytest.skip("not here")

def test_f_dies():
    os.kill(os.getpid(), signal.SIGKILL)

def test_g():
    pass
'''


def test_one_line_per_test_and_no_test_hides_another(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(RUNNER), "--out", str(out), "--timeout", "10", "test_suite.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    outcomes = {line.split()[2].split("::")[1]: line.split()[0] for line in lines}
    assert [line for line in lines if "skips" in line][0].endswith("(not here)")  # a skip says why
    assert outcomes == {
        "test_a": "passed", "test_b_faults": "failed", "test_c": "passed", "test_d_hangs": "timeout",
        "test_e_skips": "skipped", "test_f_dies": "crashed", "test_g": "passed",
    }
    reruns = sorted(out.glob("rerun-*.log"))
    assert len(reruns) == 2  # the failure and the crash; not the hang
    assert "CUDA_LAUNCH_BLOCKING = 1" in reruns[0].read_text()
    cut = list(out.glob("timeout-*.log"))
    assert len(cut) == 1
    evidence = cut[0].read_text()
    assert "in test_d_hangs" in evidence  # pytest's stack dump, taken before the cut
    assert "the server's side of the hang" in evidence
    for line in evidence.splitlines():  # the suite's fake server log, in the shared temp folder
        if line.startswith("#### server log") and "aioserve-" in line:
            Path(line.split()[3].rstrip(",")).unlink(missing_ok=True)


CUT_SUITE = '''
import time

def test_a():
    pass

def test_b_fails():
    raise AssertionError("a wrong answer")

def test_c_outlasts_the_caller():
    time.sleep(20)
'''


def test_a_runner_cut_by_its_caller_leaves_the_outcomes_so_far(tmp_path: Path) -> None:
    """The GPU call's step timeout kills the runner itself (2026-11-28: a
    retest cut at its limit brought back no summary at all): the summary is
    written after every pytest process, not only at the end."""
    import time

    (tmp_path / "test_suite.py").write_text(CUT_SUITE)
    out = tmp_path / "out"
    runner = subprocess.Popen(
        [sys.executable, str(RUNNER), "--out", str(out), "--timeout", "60", "test_suite.py"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    summary = out / "summary.txt"
    deadline = time.monotonic() + 90
    while not summary.exists() and runner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    runner.kill()  # as `timeout` does to the step; the hanging test's own process ends by itself
    runner.wait()
    outcomes = {line.split()[-1].split("::")[1]: line[:22].strip() for line in summary.read_text().splitlines()}
    assert outcomes == {"test_a": "passed", "test_b_fails": "failed", "test_c_outlasts_the_caller": "not run"}
