"""How long does one abusive request hold the event loop?

Starts a server (the demo model unless --model), sends one huge request
(by default the two from issue 14: `"hello " * 2_000_000`, 12 MB, and one
30 MB word), and meanwhile polls GET /health and runs a 5-token completion.
Prints, per abusive request: its status and time, the slowest /health answer
while it ran, the small completion's latency, and the server's own loop-lag
histogram (aioserve:event_loop_lag_seconds) from /metrics.

    python benchmarks/loop_lag.py [--model DIR] [--server-arg=--max-request-bytes=...]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerProcess  # noqa: E402

PAYLOADS = {
    "12 MB words": "hello " * 2_000_000,
    "30 MB one word": "a" * 30_000_000,
}


@dataclass
class Probe:
    name: str
    status: int | str
    seconds: float
    worst_health_s: float
    health_failures: int
    small_completion_s: float | None
    server_max_lag_s: float | None


async def _poll_health(client: httpx.AsyncClient, url: str, done: asyncio.Event) -> tuple[float, int]:
    worst, failures = 0.0, 0
    while not done.is_set():
        start = time.perf_counter()
        try:
            response = await client.get(f"{url}/health", timeout=20)
            failures += response.status_code != 200
        except httpx.HTTPError:
            failures += 1
        worst = max(worst, time.perf_counter() - start)
        await asyncio.sleep(0.05)
    return worst, failures


async def _small_completion(client: httpx.AsyncClient, url: str) -> float | None:
    await asyncio.sleep(0.2)  # let the big one get going first
    start = time.perf_counter()
    try:
        response = await client.post(
            f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5}, timeout=120
        )
    except httpx.HTTPError:
        return None
    return time.perf_counter() - start if response.status_code == 200 else None


def server_max_lag(url: str) -> float | None:
    """Upper bound of the highest non-empty bucket of the server's lag histogram."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    worst = None
    for family in text_string_to_metric_families(text):
        if family.name != "aioserve:event_loop_lag_seconds":
            continue
        previous = 0.0
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                if sample.value > previous:
                    worst = float(sample.labels["le"])
                previous = sample.value
    return worst


async def probe(url: str, name: str, prompt: str) -> Probe:
    done = asyncio.Event()
    async with httpx.AsyncClient() as client:
        health = asyncio.create_task(_poll_health(client, url, done))
        small = asyncio.create_task(_small_completion(client, url))
        start = time.perf_counter()
        body = json.dumps({"prompt": prompt, "max_tokens": 5}).encode()
        try:
            response = await client.post(
                f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120
            )
            status: int | str = response.status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        seconds = time.perf_counter() - start
        small_s = await small
        done.set()
        worst, failures = await health
    return Probe(name, status, seconds, worst, failures, small_s, server_max_lag(url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `aioserve serve` argument")
    args = parser.parse_args()
    server = ServerProcess.start(args.model, *args.server_arg)
    try:
        rows = [asyncio.run(probe(server.url, name, prompt)) for name, prompt in PAYLOADS.items()]
    finally:
        server.stop()
    print(f"{'request':<16} {'status':>8} {'took s':>8} {'worst /health s':>16} {'fails':>6} "
          f"{'5-token compl. s':>17} {'server max lag s':>17}")
    for row in rows:
        small = f"{row.small_completion_s:.3f}" if row.small_completion_s is not None else "failed"
        lag = f"<= {row.server_max_lag_s}" if row.server_max_lag_s is not None else "n/a"
        print(f"{row.name:<16} {row.status!s:>8} {row.seconds:>8.2f} {row.worst_health_s:>16.3f} "
              f"{row.health_failures:>6} {small:>17} {lag:>17}")


if __name__ == "__main__":
    main()
