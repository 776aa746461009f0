"""Memory soak: start `aioserve serve`, send N requests (completions and chat,
streamed and not, some clients leaving early, some malformed), sample the
server's RSS (/proc/PID/status VmRSS) at checkpoints and print the growth per
request between checkpoints after warm-up.

    python benchmarks/memory_soak.py --requests 5000 --warmup 500
    python benchmarks/memory_soak.py --requests 5000 -- --cache naive   # server options after --

Runs on the built-in demo model (stories260K) unless --model is given. A run
of 5,000 requests takes about 2-4 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from server_process import ServerProcess  # noqa: E402

DEMO_MODEL = Path(__file__).resolve().parent.parent / "aioserve" / "demo_model"
PROMPTS = [f"Once upon a time, {name} wanted to" for name in ("Lily", "Tom", "a cat", "the sun", "Ben", "a frog")]
BAD_BODIES = [
    {"prompt": "x", "max_tokens": -3},
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "n": 0},
]


@dataclass
class Checkpoint:
    requests: int
    rss_bytes: int
    seconds: float


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def one_request(client: httpx.AsyncClient, v1: str, rng: random.Random, max_tokens: int) -> None:
    """One request of a random kind; errors from clients that leave are expected."""
    kind = rng.random()
    if kind < 0.05:
        await client.post(f"{v1}/completions", json=rng.choice(BAD_BODIES))
        return
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    leave_after = rng.randint(1, max_tokens) if rng.random() < 0.3 else None
    body: dict = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "stream": stream}
    if chat:
        url = f"{v1}/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        url = f"{v1}/completions"
        body["prompt"] = rng.choice(PROMPTS)
    if not stream:
        if leave_after is None:
            (await client.post(url, json=body)).raise_for_status()
            return
        try:  # leave mid-generation by closing the connection
            await asyncio.wait_for(client.post(url, json=body), timeout=0.004 * leave_after)
        except asyncio.TimeoutError:
            pass
        return
    events = 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                events += 1
                if leave_after is not None and events >= leave_after:
                    return  # leaving the block closes the stream


async def soak(
    server: ServerProcess, total: int, concurrency: int, every: int, max_tokens: int, seed: int, idle_s: float
) -> list[Checkpoint]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    checkpoints = [Checkpoint(0, rss_bytes(server.process.pid), 0.0)]
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def guarded(i: int) -> None:
            async with gate:
                try:
                    await one_request(client, server.v1, rng, max_tokens)
                except httpx.HTTPError:
                    pass

        for done in range(0, total, every):
            await asyncio.gather(*(guarded(i) for i in range(done, min(done + every, total))))
            if idle_s:
                await asyncio.sleep(idle_s)  # lets the server go idle between checkpoints
            checkpoints.append(Checkpoint(min(done + every, total), rss_bytes(server.process.pid), time.monotonic() - start))
    return checkpoints


def print_table(checkpoints: list[Checkpoint], warmup: int) -> float:
    """Print RSS per checkpoint and return the growth per request after warm-up (bytes)."""
    print(f"{'requests':>9} {'seconds':>8} {'RSS MiB':>9} {'KB/request since previous':>27}")
    previous = None
    for point in checkpoints:
        per = "" if previous is None else f"{(point.rss_bytes - previous.rss_bytes) / (point.requests - previous.requests) / 1000:.2f}"
        print(f"{point.requests:>9} {point.seconds:>8.1f} {point.rss_bytes / 2**20:>9.1f} {per:>27}")
        previous = point
    base = min((p for p in checkpoints if p.requests >= warmup), key=lambda p: p.requests)
    last = checkpoints[-1]
    per_request = (last.rss_bytes - base.rss_bytes) / max(1, last.requests - base.requests)
    print(f"after warm-up ({base.requests} -> {last.requests}): {per_request / 1000:.2f} KB/request")
    return per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500, help="requests before the growth is measured")
    parser.add_argument("--every", type=int, default=500, help="requests between RSS samples")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--idle", type=float, default=0.0, help="seconds of idleness after each checkpoint's batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("server_args", nargs="*", help="extra `aioserve serve` options (after --)")
    args = parser.parse_args()
    server = ServerProcess.start(args.model, *args.server_args, timeout=300)
    try:
        checkpoints = asyncio.run(
            soak(server, args.requests, args.concurrency, args.every, args.max_tokens, args.seed, args.idle)
        )
        print_table(checkpoints, args.warmup)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
