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
