"""`aioserve serve --tp 2` over HTTP: the same answers as --tp 1 (streaming,
n > 1, concurrent clients, a prefix-cache hit, a chunked long prompt), the
layout in /server_info, followers that sleep when idle; two "nodes" on
loopback; and failures: a killed follower ends rank 0 (503, then a non-zero
exit) within 10 s, a killed rank 0 ends the followers, an unreachable
rendezvous fails start-up with a clear message."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_process import ServerProcess, free_port
from server_harness import start_server

FLAGS = ("--page-size", "4", "--max-prefill-tokens", "16")
LONG = "every morning the robot read about fish whales boats and storms " * 3  # > 16 tokens: chunked
REQUESTS = [
    dict(prompt="Once upon a time", max_tokens=16, temperature=0),
    dict(prompt=LONG, max_tokens=12, temperature=0),
    dict(prompt="The quick brown fox", max_tokens=10, temperature=0.8, seed=7, n=3),
    # No top_p/top_k here: the sampler sorts every row of a step when one row
    # uses them, which changes the token a seeded draw picks (batch-dependent).
    dict(prompt="Héllo wörld", max_tokens=10, temperature=0.7, seed=3),
    dict(prompt="a", max_tokens=8, temperature=0, n=2),
    dict(prompt="The robot smiled and said", max_tokens=14, temperature=1.0, seed=11),
]
CACHED = dict(prompt=LONG + "the end", max_tokens=8, temperature=0)  # shares LONG's pages


async def _one(client: openai.AsyncOpenAI, model: str, request: dict, stream: bool) -> list[str]:
    """The text of each choice, in index order."""
    body = dict(request)
    n = body.get("n", 1)
    if not stream:
        response = await client.completions.create(model=model, **body)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    texts = [""] * n
    async for chunk in await client.completions.create(model=model, stream=True, **body):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    return texts


def run_requests(server: ServerProcess) -> tuple[list[list[str]], list[str], int]:
    """Every request at once (odd ones streamed), then the prefix-cache hit."""
    model = server.info()["model"]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120) as client:
            texts = await asyncio.gather(*[_one(client, model, r, stream=i % 2 == 1) for i, r in enumerate(REQUESTS)])
            cached = await client.completions.create(model=model, **CACHED)
            return list(texts), [cached.choices[0].text], cached.usage.prompt_tokens_details.cached_tokens

    return asyncio.run(main())


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "(Z)" not in Path(f"/proc/{pid}/stat").read_text()


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def tp1_answers(llama_path: Path):
    server = start_server(llama_path, *FLAGS)
    try:
        yield run_requests(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tp2_server(llama_path: Path):
    server = start_server(llama_path, *FLAGS, "--tp", "2")
    follower = server.info()["tensor_parallel"]["ranks"][1]["pid"]
    try:
        yield server
    finally:
        server.stop()
        # An orderly stop: rank 0 exits 0 and its follower with it.
        assert server.process.returncode == 0, server.log()[-3000:]
        assert _wait_gone(follower, 10), "the follower outlived rank 0"


def test_tp2_answers_equal_tp1(tp2_server: ServerProcess, tp1_answers) -> None:
    texts, cached_text, cached_tokens = run_requests(tp2_server)
    expected_texts, expected_cached_text, _ = tp1_answers
    assert [len(t) for t in texts] == [r.get("n", 1) for r in REQUESTS]
    assert texts == expected_texts
    assert cached_text == expected_cached_text
    assert cached_tokens > 0, "the shared prefix should come from the prefix cache"
    info = tp2_server.wait_idle()
    assert info["kv_integrity"] == "ok"
    assert info["stats"]["cached_tokens"] > 0


def test_server_info_shows_the_layout(tp2_server: ServerProcess) -> None:
    tp = tp2_server.info()["tensor_parallel"]
    assert tp["tp_size"] == 2 and tp["nnodes"] == 1
    ranks = tp["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["attention_heads"] for r in ranks] == [[0, 2], [2, 4]]  # 4 heads
    assert [r["kv_heads"] for r in ranks] == [[0, 1], [1, 2]]  # 2 KV heads
    assert ranks[0]["vocab_rows"][1] == ranks[1]["vocab_rows"][0]
    assert ranks[0]["kv_pages"] == ranks[1]["kv_pages"] and ranks[0]["kv_bytes"] > 0
    assert ranks[0]["pid"] == tp2_server.process.pid and ranks[1]["pid"] != ranks[0]["pid"]
    assert ranks[1]["threads"] >= 1
    log = tp2_server.log()
    assert "tensor parallel: rank 1" in log and "KV heads 1" in log


def test_an_idle_follower_sleeps(tp2_server: ServerProcess) -> None:
    tp2_server.wait_idle()
    follower = tp2_server.info()["tensor_parallel"]["ranks"][1]["pid"]
    before = _cpu_seconds(follower)
    time.sleep(2.0)
    assert _cpu_seconds(follower) - before < 0.2, "an idle follower should block, not spin"


def test_killing_a_follower_ends_rank_0_within_10s(llama_path: Path) -> None:
    server = start_server(llama_path, *FLAGS, "--tp", "2")
    try:
        follower = server.info()["tensor_parallel"]["ranks"][1]["pid"]
        os.kill(follower, 9)
        killed = time.monotonic()
        statuses = set()
        while server.process.poll() is None and time.monotonic() - killed < 15:
            try:
                statuses.add(httpx.get(f"{server.url}/health", timeout=0.5).status_code)
            except httpx.HTTPError:
                statuses.add("refused")
            time.sleep(0.05)
        took = time.monotonic() - killed
        assert server.process.poll() not in (None, 0), server.log()[-3000:]
        assert took < 10, f"rank 0 took {took:.1f} s to exit"
        assert 503 in statuses, statuses
        assert "rank 1 exited or became unreachable" in server.log()
    finally:
        server.stop()


def _start_node(model: Path, node_rank: int, addr: str, *args: str, env: dict | None = None):
    log = Path(tempfile.mkstemp(prefix=f"aioserve-node{node_rank}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "aioserve", "serve", "--model", str(model), *FLAGS, "--tp", "2", "--nnodes", "2",
           "--node-rank", str(node_rank), "--dist-init-addr", addr, *args]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return process, log


def test_two_nodes_on_loopback_equal_tp2_and_die_with_rank_0(llama_path: Path, tp2_server: ServerProcess) -> None:
    addr = f"127.0.0.1:{free_port()}"
    node1, node1_log = _start_node(llama_path, 1, addr)
    node0 = None
    try:
        node0 = ServerProcess.start(llama_path, *FLAGS, "--tp", "2", "--nnodes", "2", "--node-rank", "0",
                                    "--dist-init-addr", addr, timeout=120)
        tp = node0.info()["tensor_parallel"]
        assert tp["nnodes"] == 2 and tp["ranks"][1]["pid"] == node1.pid
        texts, cached_text, cached_tokens = run_requests(node0)
        assert (texts, cached_text) == run_requests(tp2_server)[:2]
        assert cached_tokens > 0
        # Killing rank 0 ends the other node's rank.
        node0.process.kill()
        node0.process.wait()
        node1.wait(timeout=10)
        assert node1.returncode not in (None, 0)
        assert "rank 0 exited or became unreachable" in node1_log.read_text()
    finally:
        if node0 is not None:
            node0.stop()
        _kill(node1)


def test_an_unreachable_rendezvous_fails_start_up(llama_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nobody listens there
    started = time.monotonic()
    node1, log = _start_node(llama_path, 1, addr, env={"AIOSERVE_DIST_INIT_TIMEOUT": "2"})
    try:
        code = node1.wait(timeout=60)
    finally:
        _kill(node1)
    assert code == 1
    assert time.monotonic() - started < 40
    assert f"cannot reach rank 0's rendezvous at {addr}" in log.read_text()


def _post_quietly(url: str, body: dict) -> None:
    """A request whose step hangs with the follower (how it ends is not this test's)."""
    try:
        httpx.post(url, json=body, timeout=60)
    except httpx.HTTPError:
        pass


def test_a_stopped_follower_is_caught_by_the_step_bound(llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP keeps the follower's lifeline open: the step in flight not
    completing within its bound (AIOSERVE_TP_STEP_TIMEOUT, 2 s here) is what
    marks the server unhealthy and ends it non-zero."""
    monkeypatch.setenv("AIOSERVE_TP_STEP_TIMEOUT", "2")
    server = start_server(llama_path, *FLAGS, "--tp", "2")
    follower = server.info()["tensor_parallel"]["ranks"][1]["pid"]
    try:
        os.kill(follower, signal.SIGSTOP)
        stopped = time.monotonic()
        body = {"model": server.info()["model"], "prompt": "hello", "max_tokens": 8}
        threading.Thread(target=_post_quietly, args=(f"{server.v1}/completions", body), daemon=True).start()
        unhealthy_after = None
        while server.process.poll() is None and time.monotonic() - stopped < 30:
            try:
                if httpx.get(f"{server.url}/health", timeout=0.5).status_code == 503 and unhealthy_after is None:
                    unhealthy_after = time.monotonic() - stopped
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        exited_after = time.monotonic() - stopped
        assert server.process.poll() not in (None, 0), server.log()[-3000:]
        assert unhealthy_after is not None and unhealthy_after < 2 + 3, unhealthy_after
        assert exited_after < 2 + 12, exited_after
        # The request's step, or an idle heartbeat queued just before it.
        assert "did not complete within" in server.log()
    finally:
        if _alive(follower):
            os.kill(follower, signal.SIGKILL)
        server.stop()


def test_a_follower_stopped_while_idle_is_caught_without_a_request(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No request comes: rank 0 pings the followers every IDLE_PING_S (2 s)
    while no step runs, each ping answered within the step bound (2 s
    here), so a hung follower turns /health 503 within about 4 s (it was
    noticed only when the next request's step timed out)."""
    monkeypatch.setenv("AIOSERVE_TP_STEP_TIMEOUT", "2")
    server = start_server(llama_path, *FLAGS, "--tp", "2")
    follower = server.info()["tensor_parallel"]["ranks"][1]["pid"]
    try:
        time.sleep(3)  # idle, pinged: the pings alone do not fail a healthy group
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        os.kill(follower, signal.SIGSTOP)
        stopped = time.monotonic()
        unhealthy_after = None
        while unhealthy_after is None and server.process.poll() is None and time.monotonic() - stopped < 20:
            try:
                if httpx.get(f"{server.url}/health", timeout=0.5).status_code == 503:
                    unhealthy_after = time.monotonic() - stopped
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert unhealthy_after is not None and unhealthy_after < 2 + 2 + 2, (unhealthy_after, server.log()[-2000:])
        server.process.wait(15)
        assert server.process.returncode not in (None, 0)
        assert "an idle heartbeat did not complete within 2.0 s: a rank is hung" in server.log()
    finally:
        if _alive(follower):
            os.kill(follower, signal.SIGKILL)
        server.stop()


def test_a_killed_follower_gives_running_requests_a_clean_error(llama_path: Path) -> None:
    """Streams end with an OpenAI-style error event and [DONE]; a whole
    response is a 503 with a JSON error body."""
    server = start_server(llama_path, *FLAGS, "--tp", "2")
    follower = server.info()["tensor_parallel"]["ranks"][1]["pid"]
    model = server.info()["model"]
    try:
        lines: list[str] = []
        whole: list[httpx.Response] = []
        body = {"model": model, "prompt": "hello", "max_tokens": 100000, "ignore_eos": True}
        body["max_tokens"] = server.info()["max_model_len"] - 8

        def stream() -> None:
            with httpx.stream("POST", f"{server.v1}/completions", json={**body, "stream": True}, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        def non_stream() -> None:
            whole.append(httpx.post(f"{server.v1}/completions", json=body, timeout=60))

        threads = [threading.Thread(target=stream), threading.Thread(target=non_stream)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(follower, 9)
        for thread in threads:
            thread.join(30)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and "rank 1" in error["message"], error
        assert whole[0].status_code == 503, whole[0].text
        assert whole[0].json()["error"]["code"] == "server_failed"
        server.process.wait(15)
        assert server.log().count("Traceback") == 0, server.log()[-3000:]
    finally:
        server.stop()
