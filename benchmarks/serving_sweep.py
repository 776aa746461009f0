"""Start one aioserve server and run benchmarks/serving.py at several
concurrency levels against it; print one table.

    python benchmarks/serving_sweep.py --model ../shared/models/stories260K --concurrency 1 16 64 \\
        --input-len 64 --output-len 128
    python benchmarks/serving_sweep.py --model ../shared/tokenizers/qwen3 --load-format dummy --dtype bfloat16 \\
        --concurrency 1 16 64 --input-len 64 --output-len 64 --vocab-high 30000

Any option this script does not know is an `aioserve serve` flag and goes to
the server as written (so does --server-args "FLAGS", the older spelling).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import asyncio
import json
import logging
import os
import sys
import tempfile

from aioserve.cli import parse_serve_args
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerProcess  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import BenchConfig, run_benchmark  # noqa: E402

COLUMNS = [
    ("concurrency", None), ("requests", "completed"), ("out tok/s", "output_throughput"),
    ("req/s", "request_throughput"), ("TTFT mean", ("ttft_ms", "mean")), ("TTFT p99", ("ttft_ms", "p99")),
    ("TPOT mean", ("tpot_ms", "mean")), ("ITL p50", ("itl_ms", "p50")), ("ITL p99", ("itl_ms", "p99")),
    ("E2E mean", ("e2e_ms", "mean")),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--server-args", default="", help="`aioserve serve` flags, as one string")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests-per-level", type=int, default=0, help="default: max(concurrency, 4)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=500)
    p.add_argument("--json", help="write all summaries here")
    p.add_argument("--plot", metavar="OUT.png", help="output tok/s and ITL p50/p99 against concurrency")
    args, serve_flags = p.parse_known_args()
    args.serve_flags = [*args.server_args.split(), *serve_flags]
    parse_serve_args(["--model", args.model, *args.serve_flags])  # a bad flag fails here, not in the server's log
    return args


def cell(summary: dict, key: object) -> str:
    if isinstance(key, tuple):
        value = summary[key[0]][key[1]]
    else:
        value = summary[key]  # type: ignore[index]
    return "-" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))


def plot_scaling(summaries: dict[int, dict], title: str, path: str) -> None:
    """Throughput and inter-token latency against concurrency, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    levels = sorted(summaries)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(levels, [summaries[c]["output_throughput"] for c in levels], marker="o")
    left.set(xscale="log", xlabel="concurrent requests", ylabel="output tok/s", title="throughput")
    for q in ("p50", "p99"):
        right.plot(levels, [summaries[c]["itl_ms"][q] for c in levels], marker="o", label=f"ITL {q}")
    right.set(xscale="log", xlabel="concurrent requests", ylabel="ms", title="inter-token latency")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log = os.path.join(tempfile.gettempdir(), "aioserve-sweep.log")
    server = ServerProcess.start(args.model, *args.serve_flags, log_path=log)
    rows, summaries = [], {}
    try:
        for level in args.concurrency:
            config = BenchConfig(
                base_url=server.url, num_requests=args.requests_per_level or max(level, 4),
                max_concurrency=level, input_len=args.input_len, output_len=args.output_len,
                prompts_as_ids=True, vocab_low=args.vocab_low, vocab_high=args.vocab_high,
                warmup=1, label=f"c={level}", progress=False, seed=level,
            )
            summary = asyncio.run(run_benchmark(config)).summary
            summaries[level] = summary
            rows.append([str(level)] + [cell(summary, key) for _, key in COLUMNS[1:]])
    finally:
        server.stop()
    headers = [name for name, _ in COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print(f"\n{args.model} ({' '.join(args.serve_flags) or 'defaults'}); {args.input_len} in / {args.output_len} out; ms")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if args.plot:
        plot_scaling(summaries, f"{os.path.basename(args.model.rstrip('/'))}, {args.input_len} in / {args.output_len} out", args.plot)
    if args.json:
        with open(args.json, "w") as f:
            results = {"model": args.model, "server_args": " ".join(args.serve_flags), "levels": summaries}
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
