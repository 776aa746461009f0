"""A chat stream's first chunk (the role) goes out with the first token, as
OpenAI and vLLM send it, not at admission: a client that times its first
chunk measures the time to the first token. The prompt's prefill is cut into
many steps (4 tokens each), so a role chunk sent at admission would arrive
long before the first token."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_harness import RunningServer, start_server


@pytest.fixture(scope="module")
def slow_prefill_server(stories_path: Path) -> Iterator[RunningServer]:
    server = start_server(stories_path, "--chunked-prefill-size", "4", "--page-size", "4", "--debug-integrity")
    yield server
    server.stop()


def timed_events(server: RunningServer, body: dict) -> tuple[float, list[tuple[float, dict]]]:
    """(seconds to send, [(arrival in seconds, event)]) of a streamed chat."""
    events: list[tuple[float, dict]] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append((time.perf_counter() - start, json.loads(line[6:])))
    return start, events


def test_the_role_chunk_arrives_with_the_first_token(slow_prefill_server: RunningServer) -> None:
    story = "Once upon a time there was a little girl named Lily who loved to play in the park. " * 15
    model = slow_prefill_server.info()["model"]
    for opening in ("Ben", "Sue"):  # the second: no warm-up left in the figures; a new first word: no prefix hit
        body = {"model": model, "stream": True, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"{opening}. {story}"}]}
        _, events = timed_events(slow_prefill_server, body)
    first_delta = events[0][1]["choices"][0]["delta"]
    assert first_delta == {"role": "assistant", "content": ""}
    first_token = next(t for t, e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
    role_at = events[0][0]
    # Prefill takes dozens of steps; the role and the first token leave in the same step.
    assert first_token - role_at < 0.25 * first_token, (role_at, first_token)


def test_leaving_before_the_first_chunk_aborts_at_once(slow_prefill_server: RunningServer) -> None:
    """Nothing has been sent when the client leaves mid-prefill: the request
    is aborted then, and gives back every page and slot."""
    from conftest import assert_kv_intact

    story = "Lily and Tom went to the big park to see the ducks and the swans. " * 10
    body = {"model": slow_prefill_server.info()["model"], "stream": True, "max_tokens": 150, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": story}]}
    aborted = aborted_count(slow_prefill_server)
    with httpx.stream("POST", f"{slow_prefill_server.v1}/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200  # headers only: then the client goes
    info = slow_prefill_server.wait_idle(timeout=10)
    assert info["running"] == 0 and info["waiting"] == 0
    assert aborted_count(slow_prefill_server) == aborted + 1  # aborted, not run to its 150 tokens
    assert_kv_intact(slow_prefill_server)


def aborted_count(server: RunningServer) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("aioserve:request_aborted"))
