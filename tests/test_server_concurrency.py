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


def test_two_streams_are_batched_not_queued(stories_server) -> None:
    """Two streams sent together advance together: each gets chunks before
    the other's last one (a server that ran them one after the other would
    finish one stream before the other's first chunk). An ordering check:
    nothing here depends on how fast the machine is."""
    model = stories_server.info()["model"]
    arrivals: list[str] = []  # which stream each chunk came from, in arrival order

    async def stream(client: openai.AsyncOpenAI, name: str, prompt: str) -> None:
        chunks = await client.completions.create(
            model=model, prompt=prompt, max_tokens=64, temperature=0, stream=True, logprobs=0
        )
        async for _ in chunks:
            arrivals.append(name)

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=stories_server.v1, api_key="x", max_retries=0, timeout=120) as client:
            await asyncio.gather(stream(client, "a", PROMPTS[0]), stream(client, "b", PROMPTS[1]))

    asyncio.run(main())
    last = {name: max(i for i, n in enumerate(arrivals) if n == name) for name in "ab"}
    first = {name: arrivals.index(name) for name in "ab"}
    assert first["a"] < last["b"] and first["b"] < last["a"], "".join(arrivals)
    assert stories_server.wait_idle()["kv_integrity"] == "ok"


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
    # No wall-clock bound (2 shared cores make any such bound flaky): the
    # request must end as aborted, long before its 2,000 tokens, with every
    # page back. Detection is event-driven, so only a handful of steps run
    # after the client left, however slow each step is.
    info = wide_server.wait_idle(timeout=60.0)
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"]
    assert info["kv_integrity"] == "ok" and info["stats"]["aborted"] == before["stats"]["aborted"] + 1
    assert info["stats"]["generated_tokens"] - before["stats"]["generated_tokens"] < 200


def test_non_streaming_client_that_leaves_is_aborted(wide_server) -> None:
    body = {"prompt": [7] * 100, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    before = wide_server.wait_idle()
    # The read timeout is the client leaving: 0.5 s is far less than 2,000
    # tokens take, whatever the machine's load.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{wide_server.v1}/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    info = wide_server.wait_idle(timeout=60.0)
    assert info["stats"]["aborted"] == before["stats"]["aborted"] + 1
    assert info["stats"]["generated_tokens"] - before["stats"]["generated_tokens"] < 2000
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"]


def test_health_answers_during_a_long_prefill(wide_server) -> None:
    """While a 2,000-token prefill runs on the executor thread, the event loop
    keeps answering. Checked by order, not by milliseconds: once the server
    reports the request running, /health is answered several times before
    the request's response comes back, and no answer waits for a sizeable
    share of the prefill (a loop blocked by the prefill would answer one
    /health at most, and only after the prefill)."""
    wide_server.wait_idle()
    body = {"prompt": [10 + i % 300 for i in range(2000)], "max_tokens": 1, "ignore_eos": True}
    done = threading.Event()
    result: dict[str, float] = {}

    def long_request() -> None:
        try:
            result["status"] = httpx.post(f"{wide_server.v1}/completions", json=body, timeout=300).status_code
        finally:
            result["done_at"] = time.monotonic()
            done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    answered: list[tuple[float, float]] = []  # (sent, answered) of each /health after the request started
    running_at = None
    with httpx.Client(timeout=300) as client:
        while not done.is_set():
            if running_at is None:
                info = client.get(f"{wide_server.url}/server_info").json()
                if info["running"] + info["waiting"] >= 1:
                    running_at = time.monotonic()
                time.sleep(0.005)
                continue
            sent = time.monotonic()
            assert client.get(f"{wide_server.url}/health").status_code == 200
            answered.append((sent, time.monotonic()))
            time.sleep(0.01)
    thread.join()
    assert result["status"] == 200 and running_at is not None
    during = [(sent, got) for sent, got in answered if got < result["done_at"]]
    assert len(during) >= 3, f"only {len(during)} /health answers while the request ran"
    longest = max(got - sent for sent, got in during)
    assert longest < 0.5 * (result["done_at"] - running_at), "a /health call waited out much of the prefill"
