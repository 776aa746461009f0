"""A bounded soak: 300 requests, 64 at a time, a third of them walking away at
a random point, some malformed, streamed and not. Every request that stays
gets exactly what it gets alone (greedy), the server ends idle with its KV
bookkeeping intact, and its memory does not grow from one round to the next."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import assert_kv_intact
from server_harness import RunningServer, start_server

REQUESTS = 300
CONCURRENCY = 64
MAX_TOKENS = 24
PROMPTS = [f"Once upon a time, {name} wanted to" for name in ("Lily", "Tom", "a cat", "the sun", "Ben", "a frog")]
BAD_BODIES = [
    {"prompt": "x", "max_tokens": -3},
    {"prompt": "x", "temperature": -1},
    {"prompt": [], "max_tokens": 2},
    {"prompt": "x", "logit_bias": {"not-a-token": 1}},
    {"prompt": "x", "n": 0},
]


@dataclass
class Outcome:
    kind: str  # good | left | bad
    ok: bool
    detail: str = ""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def _text(client: httpx.AsyncClient, url: str, prompt: str, stream: bool, leave_after: int | None) -> str | None:
    """The completion's text, or None once it walked away (after `leave_after` events)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if not stream:
        if leave_after is None:
            response = await client.post(url, json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]
        try:  # leave mid-generation: the client closes the connection
            await asyncio.wait_for(client.post(url, json=body), timeout=0.005 * leave_after)
        except asyncio.TimeoutError:
            return None
        return None
    text, events = "", 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            if leave_after is not None and events >= leave_after:
                return None  # leaving the block closes the stream
            text += json.loads(line[6:])["choices"][0]["text"]
    return text


async def _round(server: RunningServer, references: dict[str, str], seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    url = f"{server.v1}/completions"
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)

    async def one(i: int, client: httpx.AsyncClient) -> Outcome:
        async with gate:
            if i % 10 == 3:
                response = await client.post(url, json=BAD_BODIES[i % len(BAD_BODIES)])
                body = response.json()
                ok = response.status_code == 400 and {"message", "type", "param"} <= body["error"].keys()
                return Outcome("bad", ok, response.text[:200])
            prompt = rng.choice(PROMPTS)
            stream = rng.random() < 0.5
            leave_after = rng.randint(1, MAX_TOKENS) if rng.random() < 1 / 3 else None
            text = await _text(client, url, prompt, stream, leave_after)
            if leave_after is not None:
                return Outcome("left", True)
            return Outcome("good", text == references[prompt], f"{text!r} != {references[prompt]!r}")

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one(i, client) for i in range(REQUESTS)))


@pytest.mark.slow
def test_soak(stories_path: Path) -> None:
    server = start_server(stories_path, "--page-size", "4")
    try:
        references = {}
        for prompt in PROMPTS:  # each alone
            response = httpx.post(
                f"{server.v1}/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            )
            references[prompt] = response.json()["choices"][0]["text"]
        warm = asyncio.run(_round(server, references, seed=1))
        assert all(o.ok for o in warm), [o.detail for o in warm if not o.ok][:5]
        assert_kv_intact(server)
        rss_warm = rss_bytes(server.process.pid)
        outcomes = asyncio.run(_round(server, references, seed=2))
        assert_kv_intact(server)
        rss_after = rss_bytes(server.process.pid)
        failures = [o.detail for o in outcomes if not o.ok]
        assert not failures, failures[:5]
        kinds = {kind: sum(o.kind == kind for o in outcomes) for kind in ("good", "left", "bad")}
        print(f"soak: {kinds}, RSS after warm-up {rss_warm / 2**20:.1f} MiB, after the run {rss_after / 2**20:.1f} MiB")
        assert kinds["left"] >= 60 and kinds["bad"] >= 20 and kinds["good"] >= 120
        assert rss_after <= 1.10 * rss_warm
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
