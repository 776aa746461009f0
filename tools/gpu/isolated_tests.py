"""Run pytest tests so that one cannot hide the others, with a line per test.

A CUDA fault is sticky: after the first "misaligned address" every later
CUDA call of the process fails, so one bad test turned 27 others into errors
far from its cause (issue 26). Here the tests run file by file with `-x`;
when one fails, the process ends, that test is run again alone with
CUDA_LAUNCH_BLOCKING=1 (so its log names the faulting kernel), and the file
goes on in a fresh process from the test after it. A test that hangs is
cut at its timeout and reported, and the rest go on.

Usage (benchmarks/gpu_check.sh tests does this):
    python tools/gpu/isolated_tests.py --out DIR [--timeout S] [--budget S] [-m MARK] FILE...
Writes DIR/summary.txt (one line per test: outcome, seconds, node id;
rewritten after each pytest process, so a cut run leaves what it found),
DIR/<n>.log (each pytest process's console), DIR/rerun-<n>.log (each
isolated rerun) and DIR/timeout-<n>.log (a cut test's evidence: pytest's
stack dump taken before the cut, and the tails of the server logs it
started); exits 1 if any test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parent  # holds lines_plugin.py, loaded with -p
OK = ("passed", "skipped")


@dataclass
class Outcome:
    nodeid: str
    outcome: str  # passed | failed | error | skipped | timeout | crashed | not run (| X-then-passed-alone)
    seconds: float
    why: str = ""  # a skip's reason


def collect(files: list[str], mark: str | None) -> list[str]:
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    if mark:
        args += ["-m", mark]
    listed = subprocess.run(args, capture_output=True, text=True)
    nodeids = [line.strip() for line in listed.stdout.splitlines() if "::" in line]
    if not nodeids:  # a conftest that fails to import collects nothing: say why
        print(listed.stdout[-4000:], listed.stderr[-4000:], sep="\n", file=sys.stderr)
    return nodeids


def run_pytest(nodeids: list[str], lines: Path, log: Path, timeout: float, budget: float, env: dict[str, str]) -> bool:
    """One pytest process over `nodeids`, stopping at the first failure.
    False if it was killed: no test finished for `timeout` seconds, or the budget ran out."""
    # faulthandler_timeout: pytest dumps every thread's stack into the log
    # shortly before this runner would cut the test, so a hang says where it waits.
    args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "lines_plugin",
            "-o", "addopts=", "-o", f"faulthandler_timeout={timeout - min(15.0, timeout / 2):g}", *nodeids]
    env = {**env, "PYTHONPATH": f"{PLUGIN_DIR}{os.pathsep}{env.get('PYTHONPATH', '')}", "TEST_LINES_FILE": str(lines)}
    start = last_progress = time.monotonic()
    seen = 0
    with log.open("w") as out:
        # Its own session: a kill takes the test's children (servers, compilers) with it.
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while process.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            size = lines.stat().st_size if lines.exists() else 0
            if size != seen:
                seen, last_progress = size, now
            if now - last_progress > timeout or now - start > budget:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                out.write(f"\n#### killed: no test finished in {timeout:.0f} s, or the budget ran out\n")
                return False
    return True


def read_lines(lines: Path) -> dict[str, Outcome]:
    found: dict[str, Outcome] = {}
    if lines.exists():
        for line in lines.read_text().splitlines():
            record = json.loads(line)
            found[record["nodeid"]] = Outcome(record["nodeid"], record["outcome"], record["seconds"], record.get("why", ""))
    lines.unlink(missing_ok=True)
    return found


SERVER_LOGS = "aioserve-*.log"  # where tools/server_process.py writes a test server's console


def timeout_evidence(console: Path, since: float, tail: int = 8000) -> str:
    """What a cut test leaves behind: the end of its pytest console (the stack
    dump included) and the end of every server log written since `since`."""
    parts = [f"#### {console.name}, last {tail} characters\n{console.read_text(errors='replace')[-tail:]}"]
    for log in sorted(Path(tempfile.gettempdir()).glob(SERVER_LOGS)):
        if log.stat().st_mtime >= since:
            parts.append(f"#### server log {log}, last {tail} characters\n{log.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts) + "\n"


def run_isolated(nodeids: list[str], out: Path, timeout: float, budget: float) -> list[Outcome]:
    """Every test's outcome; a failure is rerun alone with CUDA_LAUNCH_BLOCKING=1."""
    start = time.monotonic()
    results: dict[str, Outcome] = {}
    remaining = list(nodeids)
    runs = 0
    while remaining and (left := budget - (time.monotonic() - start)) > 10:
        runs += 1
        lines = out / f"{runs}.lines"
        began = time.time()
        finished = run_pytest(remaining, lines, out / f"{runs}.log", timeout, left, dict(os.environ))
        got = read_lines(lines)
        results.update(got)
        # The first test that did not pass or skip ends this process's share.
        stop = next((i for i, n in enumerate(remaining) if got.get(n, Outcome(n, "", 0)).outcome not in OK), None)
        if stop is None:
            break
        culprit = remaining[stop]
        if culprit not in got:  # killed while it ran, or the process died under it
            results[culprit] = Outcome(culprit, "crashed" if finished else "timeout", 0.0 if finished else timeout)
        if results[culprit].outcome == "timeout":
            (out / f"timeout-{runs}.log").write_text(timeout_evidence(out / f"{runs}.log", began))
        else:
            blocking = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
            rerun = out / f"rerun-{runs}.lines"
            run_pytest([culprit], rerun, out / f"rerun-{runs}.log", timeout, max(left, 10), blocking)
            alone = read_lines(rerun).get(culprit)
            if alone is not None and alone.outcome in OK:
                first = results[culprit]
                results[culprit] = Outcome(culprit, f"{first.outcome}-then-{alone.outcome}-alone", first.seconds)
        remaining = remaining[stop + 1 :]
        write_summary(out, outcomes(nodeids, results))
    return outcomes(nodeids, results)


def outcomes(nodeids: list[str], results: dict[str, Outcome]) -> list[Outcome]:
    return [results.get(n, Outcome(n, "not run", 0.0)) for n in nodeids]


def summary_lines(found: list[Outcome]) -> str:
    return "\n".join(
        f"{o.outcome:<22} {o.seconds:7.1f}s  {o.nodeid}" + (f"  ({o.why})" if o.why else "") for o in found
    )


def write_summary(out: Path, found: list[Outcome]) -> None:
    """Written after every pytest process, not only at the end: a caller's
    timeout that cuts this runner still leaves the outcomes so far."""
    (out / "summary.txt").write_text(summary_lines(found) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=300, help="seconds one test may take")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds for the whole run")
    parser.add_argument("-m", dest="mark", default=None, help="pytest -m expression for collection")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    found = run_isolated(collect(args.files, args.mark), args.out, args.timeout, args.budget)
    write_summary(args.out, found)
    print(summary_lines(found))
    counts: dict[str, int] = {}
    for o in found:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if all(o.outcome in OK for o in found) else 1


if __name__ == "__main__":
    sys.exit(main())
