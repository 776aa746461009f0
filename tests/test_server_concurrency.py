"""Many clients at once, overlap on and off, a loop that is never blocked,
and clients that leave early."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from server_harness import start_server

PROMPTS = [f"{name} went to the {place}." for name in ("Lily", "Ben", "Tom", "Sue") for place in
           ("park", "sea", "shop", "farm", "zoo", "woods", "lake", "town")]


async def stream_text(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, **kwargs) -> str:
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **kwargs
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def run_clients(server, requests: list[tuple[str, int, dict]], concurrent: bool) -> list[str]:
    model = server.info()["model"]

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120) as client:
            calls = [stream_text(client, model, p, n, **kw) for p, n, kw in requests]
            if concurrent:
                return list(await asyncio.gather(*calls))
            return [await call for call in calls]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def requests_mix() -> list[tuple[str, int, dict]]:
    mix = []
    for i, prompt in enumerate(PROMPTS):
        kwargs = {"temperature": 0} if i % 3 else {"temperature": 0.8, "seed": i}
        mix.append((prompt, 8 + (i * 7) % 40, kwargs))
    return mix


@pytest.fixture(scope="module")
def sequential(stories_server, requests_mix) -> list[str]:
    return run_clients(stories_server, requests_mix, concurrent=False)


def test_32_concurrent_streams_get_what_they_get_alone(stories_server, requests_mix, sequential) -> None:
    assert len(requests_mix) == 32
    assert run_clients(stories_server, requests_mix, concurrent=True) == sequential
    info = stories_server.wait_idle()
    assert info["kv_integrity"] == "ok"


def test_overlap_off_agrees(stories_path, requests_mix, sequential) -> None:
    server = start_server(stories_path, "--page-size", "4", "--disable-overlap")
    try:
        assert server.info()["overlap"] is False
        assert run_clients(server, requests_mix, concurrent=True) == sequential
    finally:
        server.stop()


def test_disconnect_frees_everything_at_once(wide_server) -> None:
    before = wide_server.wait_idle()
    # logprobs make every token send a chunk, even one whose text is empty.
    body = {"prompt": [5] * 300, "max_tokens": 2000, "stream": True, "ignore_eos": True, "logprobs": 0}
    with httpx.stream("POST", f"{wide_server.v1}/completions", json=body, timeout=30) as response:
        tokens = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                tokens += len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
            if tokens >= 3:
                assert wide_server.info()["running"] == 1
                break  # leaving the iterator closes the connection
    left_at = time.monotonic()
    info = wide_server.wait_idle(timeout=1.0)
    assert time.monotonic() - left_at < 1.0
    # Every page is free or an unlocked (evictable) prefix-cache page again.
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"]
    assert info["kv_integrity"] == "ok" and info["stats"]["aborted"] == before["stats"]["aborted"] + 1
    assert info["stats"]["generated_tokens"] - before["stats"]["generated_tokens"] < 100


def test_non_streaming_client_that_leaves_is_aborted(wide_server) -> None:
    body = {"prompt": [7] * 100, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    aborted_before = wide_server.wait_idle()["stats"]["aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{wide_server.v1}/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    info = wide_server.wait_idle(timeout=1.0)
    assert info["stats"]["aborted"] == aborted_before + 1
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"]


def test_health_answers_during_a_long_prefill(wide_server) -> None:
    body = {"prompt": [10 + i % 300 for i in range(2000)], "max_tokens": 1, "ignore_eos": True}
    done = threading.Event()
    timing: dict[str, float] = {}

    def long_request() -> None:
        start = time.monotonic()
        try:
            timing["status"] = httpx.post(f"{wide_server.v1}/completions", json=body, timeout=120).status_code
            timing["request"] = time.monotonic() - start
        finally:
            done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    latencies = []
    with httpx.Client() as client:
        while not done.is_set():
            start = time.monotonic()
            assert client.get(f"{wide_server.url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    thread.join()
    assert timing["status"] == 200
    assert timing["request"] > 0.5, "the prefill was too short to prove anything"
    assert len(latencies) >= 5
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms"
