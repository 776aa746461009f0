"""Prefix cache and chunked prefill, each measured against its "off" setting
in one run, on servers this script starts itself.

* prefix:   N requests over K shared system prompts of L tokens; radix cache
            vs naive. Reports duration, TTFT and the prompt tokens computed.
* chunking: S streams decode; once they run, one long prompt arrives. Reports
            the streams' inter-token latency (p50/p99/max) with
            --max-prefill-tokens CHUNK vs one unchunked prefill.

    python benchmarks/dummy_model.py --tokenizer ../shared/tokenizers/qwen3 --out /tmp/qwen3-mini \\
        --layers 8 --hidden 512 --intermediate 1536 --heads 8 --kv-heads 4 --head-dim 64
    python benchmarks/prefix_and_chunking.py --model /tmp/qwen3-mini --load-format dummy

Any option this script does not know is an `aioserve serve` flag and goes to
every server as written (so does --server-args "FLAGS", the older spelling).
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
import time

import httpx
import numpy as np

from aioserve.cli import parse_serve_args
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerProcess  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import BenchConfig, run_benchmark  # noqa: E402

logger = logging.getLogger("benchmarks.prefix_and_chunking")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", choices=["prefix", "chunking", "both"], default="both")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    # prefix workload
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--prefix-output-len", type=int, default=16)
    # chunking workload
    p.add_argument("--streams", type=int, default=16)
    # Short enough that the stalled gaps (one per stream) are over 1% of all:
    # p99 then shows a stall instead of averaging it away.
    p.add_argument("--stream-output-len", type=int, default=64)
    p.add_argument("--long-prompt-len", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=256, help="--max-prefill-tokens with chunking on")
    p.add_argument("--long-prompt-delay", type=float, default=2.0, help="seconds after the streams start")
    p.add_argument("--vocab-low", type=int, default=1000)
    p.add_argument("--vocab-high", type=int, default=30000)
    p.add_argument("--json", help="write all results here")
    p.add_argument("--plot", help="PNG: ITL distributions of the chunking workload")
    args, serve_flags = p.parse_known_args()
    args.serve_flags = [*args.server_args.split(), *serve_flags]
    parse_serve_args(["--model", args.model, *args.serve_flags])  # a bad flag fails here, not in a server's log
    return args


def server_for(args: argparse.Namespace, extra: list[str], name: str) -> ServerProcess:
    flags = [*args.serve_flags, *extra]  # extra last: argparse keeps an option's last value
    log = os.path.join(tempfile.gettempdir(), f"aioserve-bench-{name}.log")
    logger.info("starting %s: %s", name, " ".join(flags))
    return ServerProcess.start(args.model, *flags, log_path=log)


def prefix_workload(args: argparse.Namespace) -> list[dict]:
    rows = []
    for cache in ("radix", "naive"):
        server = server_for(args, ["--cache", cache], f"prefix-{cache}")
        try:
            config = BenchConfig(
                base_url=server.url, num_requests=args.num_requests, input_len=args.suffix_len,
                output_len=args.prefix_output_len, shared_prefix_len=args.prefix_len,
                num_prefixes=args.num_prefixes, prompts_as_ids=True, vocab_low=args.vocab_low,
                vocab_high=args.vocab_high, warmup=0, label=f"prefix {cache}", progress=False,
            )
            result = asyncio.run(run_benchmark(config))
            stats = server.info()["stats"]
            s = result.summary
            rows.append({
                "cache": cache, "duration_s": s["duration_s"], "ttft_mean_ms": s["ttft_ms"]["mean"],
                "ttft_p99_ms": s["ttft_ms"]["p99"], "output_tok_s": s["output_throughput"],
                "prompt_tokens": stats["prompt_tokens"], "cached_tokens": stats["cached_tokens"],
                "prefill_tokens_computed": stats["prefill_tokens"], "completed": s["completed"],
            })
        finally:
            server.stop()
    return rows


async def _long_prompt(url: str, args: argparse.Namespace) -> float:
    await asyncio.sleep(args.long_prompt_delay)
    rng = np.random.default_rng(1)
    prompt = rng.integers(args.vocab_low, args.vocab_high, args.long_prompt_len).tolist()
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        response = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        response.raise_for_status()
        return time.perf_counter() - start


def chunking_workload(args: argparse.Namespace) -> tuple[list[dict], dict[str, list[float]]]:
    rows, itls = [], {}
    settings = [("chunked", args.chunk), ("unchunked", max(8192, args.long_prompt_len + 64))]
    for name, budget in settings:
        server = server_for(args, ["--max-prefill-tokens", str(budget)], f"chunk-{name}")
        try:
            # Warm up here, not inside the run: a warm-up request there would
            # delay the streams, and the long prompt could land before they start.
            httpx.post(f"{server.url}/v1/completions", json={"prompt": [args.vocab_low] * 8, "max_tokens": 4},
                       timeout=120).raise_for_status()
            config = BenchConfig(
                base_url=server.url, num_requests=args.streams, input_len=64, output_len=args.stream_output_len,
                prompts_as_ids=True, vocab_low=args.vocab_low, vocab_high=args.vocab_high, warmup=0,
                label=name, progress=False,
            )

            async def both():
                return await asyncio.gather(run_benchmark(config), _long_prompt(server.url, args))

            result, long_latency = asyncio.run(both())
            gaps = [gap for record in result.records for gap in record.itls]
            itls[name] = gaps
            ms = np.array(gaps) * 1000
            rows.append({
                "setting": name, "max_prefill_tokens": budget, "itl_p50_ms": float(np.percentile(ms, 50)),
                "itl_p99_ms": float(np.percentile(ms, 99)), "itl_max_ms": float(ms.max()),
                "long_prompt_latency_s": long_latency, "stream_output_tok_s": result.summary["output_throughput"],
            })
        finally:
            server.stop()
    return rows, itls


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    widths = [max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for row in rows:
        print("  ".join(_fmt(row[k]).ljust(w) for k, w in zip(keys, widths)))


def _fmt(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def plot_itls(itls: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, gaps in itls.items():
        ms = np.sort(np.array(gaps) * 1000)
        ax.plot(ms, np.linspace(0, 1, len(ms)), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency of the running streams (ms)")
    ax.set_ylabel("CDF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results: dict[str, object] = {"model": args.model}
    if args.workload in ("prefix", "both"):
        results["prefix"] = rows = prefix_workload(args)
        print_rows(f"shared prefix: {args.num_requests} requests, {args.num_prefixes} prefixes of {args.prefix_len} tokens", rows)
    if args.workload in ("chunking", "both"):
        rows, itls = chunking_workload(args)
        results["chunking"] = rows
        print_rows(f"{args.long_prompt_len}-token prompt arriving while {args.streams} streams decode", rows)
        if args.plot:
            plot_itls(itls, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
