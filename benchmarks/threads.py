"""Decode speed by thread count, on an idle CPU and beside a competing load.

On a shared machine the default (one thread per core) can collapse: a
thread team waits at every barrier for its slowest member, and a member
that shares its core with another process is slow. This measures, for each
--num-threads value, the time one request takes to generate a fixed number
of tokens, with nothing else running and with N busy processes beside it,
the configurations alternated run by run so that drift in the machine's
state is spread over all of them.

    python benchmarks/threads.py                                   # demo model, threads 1 and all cores
    python benchmarks/threads.py --model ../shared/tokenizers/qwen3 --load-format dummy --dtype bfloat16 \\
        --threads 1 2 --busy 0 1 --tokens 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger("benchmarks.threads")
REPO = Path(__file__).resolve().parents[1]

# One child per (threads, repeat): it loads the model once, warms up, then
# times `repeats` generations of `tokens` tokens, printing seconds as JSON.
CHILD = """
import json, sys, time
from aioserve import LLM, SamplingParams
model, load_format, dtype, threads, tokens, repeats = sys.argv[1:7]
options = {"num_threads": int(threads), "dtype": dtype}
if load_format != "auto":
    options["load_format"] = load_format
llm = LLM(model, **options)
params = SamplingParams(max_tokens=int(tokens), temperature=0, ignore_eos=True)
llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)
times = []
for _ in range(int(repeats)):
    start = time.perf_counter()
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)
    times.append(time.perf_counter() - start)
llm.close()
print("RESULT " + json.dumps(times))
"""


@dataclass
class Row:
    threads: int
    busy: int  # competing processes, each spinning on one core
    wait_policy: str  # OMP_WAIT_POLICY of the run ("default": unset)
    seconds: list[float]  # per generation of `tokens` tokens

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def spin() -> None:
    while True:
        pass


def timed_child(args: argparse.Namespace, threads: int, wait_policy: str) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if wait_policy.startswith("spin"):  # libgomp's spin before a waiting thread sleeps
        env["GOMP_SPINCOUNT"] = wait_policy[4:]
    elif wait_policy != "default":
        env["OMP_WAIT_POLICY"] = wait_policy
    done = subprocess.run(
        [sys.executable, "-c", CHILD, args.model, args.load_format, args.dtype, str(threads), str(args.tokens),
         str(args.repeats)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=1800,
    )
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not result:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(result[-1][7:])


def measure(args: argparse.Namespace) -> list[Row]:
    rows = {(t, b, w): Row(t, b, w, []) for b in args.busy for t in args.threads for w in args.wait_policy}
    order = [key for _ in range(args.rounds) for key in rows]  # alternated, round by round
    for threads, busy, wait_policy in tqdm(order, desc="runs"):
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            rows[(threads, busy, wait_policy)].seconds += timed_child(args, threads, wait_policy)
        finally:
            for p in spinners:
                p.terminate()
                p.join()
    return list(rows.values())


def print_table(rows: list[Row], tokens: int) -> None:
    print(f"{'threads':>7} {'busy':>4} {'OMP wait':>8} {'median s':>9} {'tok/s':>7} {'min s':>7} {'max s':>7}"
          f"  ({tokens} tokens a run)")
    for r in rows:
        print(f"{r.threads:>7} {r.busy:>4} {r.wait_policy:>8} {r.median:>9.2f} {tokens / r.median:>7.1f} {min(r.seconds):>7.2f} "
              f"{max(r.seconds):>7.2f}")


def main() -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "aioserve" / "demo_model"))
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", nargs="+", type=int, default=sorted({1, cores}))
    parser.add_argument("--busy", nargs="+", type=int, default=[0, 1], help="competing busy processes")
    parser.add_argument("--wait-policy", nargs="+", default=["default"],
                        help="OMP_WAIT_POLICY of the runs (default, passive, active), or spinN: GOMP_SPINCOUNT=N")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per child")
    parser.add_argument("--rounds", type=int, default=2, help="children per configuration, alternated")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logger.info("%d cores; %s", cores, Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0]
                if Path("/proc/cpuinfo").exists() else "")
    start = time.perf_counter()
    rows = measure(args)
    print_table(rows, args.tokens)
    logger.info("measured in %.0f s", time.perf_counter() - start)
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "median": r.median} for r in rows], indent=2))


if __name__ == "__main__":
    main()
