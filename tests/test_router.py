"""Two replicas of stories260K behind SGLang's router (`sglang-router` from
PyPI, launched with the flags `aioserve serve --dp` gives it): greedy
answers through the router equal a single replica's; both replicas serve;
prompts sharing a long prefix land where it is cached (cache_aware, against
round_robin); killing a replica mid-run loses only requests in flight, later
ones all succeed, and the restarted replica is routed to again. The
endpoints the router called on the replicas are read from their access logs
and printed (run with -s), with the figures. vllm-router, in front of the
same replicas, gives the same answers and uses both."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from server_process import free_port, process_gone, wait_for_health

from aioserve.config import ROUTER_POLICIES, EngineConfig, ServerArgs
from aioserve.data_parallel import router_command

pytest.importorskip("sglang_router", reason="sglang-router is not installed: pip install -e '.[router]'")

MODEL_NAME = "stories260K"
REPLICA_FLAGS = ("--served-model-name", MODEL_NAME, "--num-threads", "1", "--access-log")
STORY_WORDS = "cat dog sun tree ball girl boy park cake bird fish boat rain moon star hat".split()
# "127.0.0.1:5000 - - [date] "GET /health 1.1" 200 0 "-" "user agent""
ACCESS_LINE = re.compile(r'"(GET|POST) (\S+) [\d.]+" (\d+) \S+ "[^"]*" "([^"]*)"')


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it is still there 30 s later."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Replica:
    port: int
    log: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, model: Path) -> None:
        command = [sys.executable, "-m", "aioserve", "serve", "--model", str(model), "--port", str(self.port)]
        with self.log.open("a") as out:
            self.process = subprocess.Popen([*command, *REPLICA_FLAGS], stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        assert self.process is not None
        why = wait_for_health(self.url, process_gone(self.process, self.log.read_text), timeout)
        if why is not None:
            raise TimeoutError(f"replica on {self.port} not healthy: {why}\n{self.log.read_text()[-3000:]}")

    def finished(self) -> int:
        return httpx.get(f"{self.url}/server_info", timeout=30).json()["stats"]["finished"]

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def router_calls(self) -> Counter[str]:
        """What the router asked of this replica: the access log's lines
        without a user agent (the test's own calls come from httpx)."""
        calls: Counter[str] = Counter()
        for match in ACCESS_LINE.finditer(self.log.read_text(errors="replace")):
            method, path, _status, agent = match.groups()
            if not agent.startswith("python-httpx"):
                calls[f"{method} {path}"] += 1
        return calls


@dataclass
class Router:
    url: str
    process: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, replicas: list[Replica], policy: str, log: Path) -> "Router":
        port = free_port()
        args = ServerArgs(
            engine=EngineConfig(), host="127.0.0.1", port=port, router_policy=policy, log_level="warning",
            router_args=f"--prometheus-port {free_port()} --prometheus-host 127.0.0.1",
        )
        command = router_command(args, [r.url for r in replicas])
        with log.open("a") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        router = cls(f"http://127.0.0.1:{port}", process, log)
        router.wait_workers_healthy(len(replicas))
        return router

    def healthy_workers(self) -> set[str]:
        try:
            workers = httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {w["url"] for w in workers if w["is_healthy"]}

    def wait_workers_healthy(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.healthy_workers()) < count:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"router: {self.healthy_workers()}\n{self.log.read_text()[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.process)


# -- requests -----------------------------------------------------------------------------


def completion(base: str, prompt: str, max_tokens: int = 12) -> tuple[str, int]:
    """Greedy text and cached prompt tokens of one /v1/completions call."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def streamed_chat(base: str, content: str, max_tokens: int = 12) -> str:
    body = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
    }
    text, done = [], False
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    assert done, "the stream ended without [DONE]"
    return "".join(text)


def story(i: int, words: int) -> str:
    return " ".join(STORY_WORDS[(i * 7 + k * 3) % len(STORY_WORDS)] for k in range(words))


# Each starts its own way: under cache_aware, prompts that share most of
# their text go to one replica (as they should), new ones to the emptier one.
COMPLETION_PROMPTS = [f"{story(i, 3)} {i} once upon a time" for i in range(40)]
CHAT_MESSAGES = [f"{story(i + 3, 2)} {i}, tell me a story" for i in range(20)]


def shared_prefix(group: int, policy: str) -> str:
    """~300 characters, its own per group and policy: > 2 KV pages of tokens."""
    return f"{policy} story {group}: " + " ".join(story(group * 5 + k, 4) for k in range(14)) + ". "


def run_rounds(base: str, policy: str, groups: int, rounds: int) -> list[list[int]]:
    """Round r sends each group's prefix with its r-th suffix, all groups at
    once (sglang-router's cache_aware sends a prefix it has not seen to the
    least busy replica, so a round sent one by one would all go to the
    first); cached_tokens per [round][group]."""

    def send(r: int, g: int) -> int:
        return completion(base, shared_prefix(g, policy) + f"Then {story(r + g, 2)}", max_tokens=4)[1]

    with ThreadPoolExecutor(groups) as pool:
        return [list(pool.map(lambda g: send(r, g), range(groups))) for r in range(rounds)]


def same_answers_as_one_replica(
    router: Router, replicas: list[Replica], prompts: list[str], messages: list[str], concurrency: int
) -> list[int]:
    """Completions and streamed chats through the router, `concurrency` at a
    time, answer as replica 0 alone does (asked first, one by one); returns
    how many of them each replica served."""
    reference = [completion(replicas[0].url, p)[0] for p in prompts]
    chat_reference = [streamed_chat(replicas[0].url, m) for m in messages]
    before = [r.finished() for r in replicas]
    with ThreadPoolExecutor(concurrency) as pool:
        texts = list(pool.map(lambda p: completion(router.url, p)[0], prompts))
        chats = list(pool.map(lambda m: streamed_chat(router.url, m), messages))
    assert texts == reference
    assert chats == chat_reference
    return [r.finished() - n for r, n in zip(replicas, before)]


# -- the test ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(stories_path: Path):
    logs = Path(tempfile.mkdtemp(prefix="aioserve-router-"))
    started = [Replica(free_port(), logs / f"replica{i}.log") for i in range(2)]
    for replica in started:
        replica.start(stories_path)
    try:
        for replica in started:
            replica.wait_healthy()
        yield started
    finally:
        for replica in started:
            replica.stop()


def test_router_policies_are_the_routers() -> None:
    """config.ROUTER_POLICIES (spelled out there) are choices sglang-router takes."""
    from sglang_router.launch_router import parse_router_args

    for policy in ROUTER_POLICIES:
        assert parse_router_args(["--policy", policy]).policy == policy


@pytest.mark.slow  # ~30 s; test_data_parallel.py's --dp 2 runs keep sglang-router in the default suite
def test_two_replicas_behind_sglang_router(replicas: list[Replica], stories_path: Path) -> None:
    import sglang_router.version

    a, b = replicas
    logs = a.log.parent
    figures: dict[str, object] = {"router": f"sglang-router {sglang_router.version.__version__}"}

    router = Router.start(replicas, "cache_aware", logs / "router-cache_aware.log")
    try:
        # 1. 60 requests through the router, 8 at a time: the same answers, both replicas serving.
        served = same_answers_as_one_replica(router, replicas, COMPLETION_PROMPTS, CHAT_MESSAGES, concurrency=8)
        figures["requests per replica (60 through the router)"] = served
        assert sum(served) == 60 and min(served) > 0, served

        # 2. Shared long prefixes: repeats land where the prefix is cached.
        flushed = httpx.post(f"{router.url}/flush_cache", timeout=30)  # fanned out to both replicas
        assert flushed.status_code == 200, flushed.text
        groups, rounds = 9, 3
        before = [r.finished() for r in replicas]
        cached = run_rounds(router.url, "cache_aware", groups, rounds)
        figures["cache_aware: shared-prefix requests per replica"] = [
            r.finished() - n for r, n in zip(replicas, before)
        ]
        repeats = [c for row in cached[1:] for c in row]
        figures["cache_aware: repeats with cached_tokens > 0"] = f"{sum(c > 0 for c in repeats)}/{len(repeats)}"
        figures["cache_aware: cached tokens"] = sum(map(sum, cached))
        assert sum(c > 0 for c in repeats) >= 0.9 * len(repeats), cached

        # 3. Failover: kill replica b mid-run (SIGKILL: no drain).
        outcomes = failover_run(router, b)
        figures["failover"] = outcomes.summary()
        assert outcomes.lost_after_kill == [], outcomes.summary()
        assert set(outcomes.failed) <= outcomes.in_flight_at_kill, outcomes.summary()

        # 4. b restarted on its port: the router takes it back and routes to it.
        b.start(stories_path)
        b.wait_healthy()
        router.wait_workers_healthy(2, timeout=30)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: completion(router.url, f"{story(i + 5, 4)} {i} after the restart"), range(12)))
        figures["requests on the restarted replica (of 12)"] = b.finished()
        assert b.finished() > 0

        # 5. b hangs (SIGSTOP: alive, answering nothing): its health checks time out and
        # the router takes it out; requests then all go to a; b back once it answers again.
        b.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            frozen_at = time.monotonic()
            while b.url in router.healthy_workers():
                assert time.monotonic() - frozen_at < 15, "a hung replica stayed in the router's rotation"
                time.sleep(0.2)
            figures["a hung replica taken out after (s)"] = round(time.monotonic() - frozen_at, 1)
            served_by_a = a.finished()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: completion(router.url, f"{story(i + 9, 4)} {i} while b hangs"), range(8)))
            assert a.finished() - served_by_a == 8
        finally:
            b.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        router.wait_workers_healthy(2, timeout=15)
    finally:
        router.stop()

    # 6. The same shared-prefix rounds under round_robin, for comparison.
    rr = Router.start(replicas, "round_robin", logs / "router-round_robin.log")
    try:
        httpx.post(f"{rr.url}/flush_cache", timeout=30).raise_for_status()
        cached_rr = run_rounds(rr.url, "round_robin", groups, rounds)
    finally:
        rr.stop()
    repeats_rr = [c for row in cached_rr[1:] for c in row]
    figures["round_robin: repeats with cached_tokens > 0"] = f"{sum(c > 0 for c in repeats_rr)}/{len(repeats_rr)}"
    figures["round_robin: cached tokens"] = sum(map(sum, cached_rr))
    assert sum(c > 0 for c in repeats) >= sum(c > 0 for c in repeats_rr)

    calls = a.router_calls() + b.router_calls()
    figures["endpoints the router called on the replicas"] = dict(sorted(calls.items()))
    print("\n" + json.dumps(figures, indent=2))
    for endpoint in ("GET /health", "GET /server_info", "GET /model_info", "POST /flush_cache",
                     "POST /v1/completions", "POST /v1/chat/completions"):
        assert calls[endpoint] > 0, (endpoint, calls)
    assert not [c for c in calls if c.startswith("GET /get_")], "the router fell back to a deprecated name"


def test_vllm_router_routes_to_the_replicas(replicas: list[Replica]) -> None:
    """vllm-router (cache_aware) in front of the same replicas: its
    /v1/completions/render probe gets 404 and it sends the request on as it is."""
    pytest.importorskip("vllm_router", reason="vllm-router is not installed: pip install -e '.[router]'")
    port = free_port()
    log = replicas[0].log.parent / "vllm-router.log"
    command = [
        sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[r.url for r in replicas], "--policy", "cache_aware", "--log-level", "warning",
        "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1", "--health-check-interval-secs", "1",
    ]
    with log.open("a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    router = Router(f"http://127.0.0.1:{port}", process, log)
    calls_before = replicas[0].router_calls() + replicas[1].router_calls()
    try:
        router.wait_workers_healthy(2)
        prompts, messages = COMPLETION_PROMPTS[:12], CHAT_MESSAGES[:4]
        served = same_answers_as_one_replica(router, replicas, prompts, messages, concurrency=4)
        generated = httpx.post(
            f"{router.url}/generate", json={"text": "Once upon", "sampling_params": {"max_new_tokens": 4}}, timeout=60
        )
        assert generated.status_code == 200 and generated.json()["meta_info"]["completion_tokens"] == 4
        calls = replicas[0].router_calls() + replicas[1].router_calls() - calls_before
        # It passes the client's user agent on with the requests it routes: those are not counted here.
        print(f"\nvllm-router: requests per replica {served} (of 16); it called {dict(sorted(calls.items()))}")
        assert min(served) > 0, served
        assert calls["GET /health"] > 0 and calls["POST /tokenize"] > 0
    finally:
        router.stop()


@dataclass
class FailoverOutcomes:
    sent: int
    failed: dict[int, str]
    in_flight_at_kill: set[int]
    lost_after_kill: list[int]

    def summary(self) -> str:
        return (
            f"{self.sent} requests, {len(self.in_flight_at_kill)} in flight at the kill, "
            f"{len(self.failed)} failed ({sorted(self.failed)}), {len(self.lost_after_kill)} sent later lost"
        )


def failover_run(router: Router, victim: Replica, total: int = 30, kill_after: int = 10) -> FailoverOutcomes:
    """`total` requests (completions and streamed chats, 4 at a time); the
    victim gets SIGKILL once `kill_after` of them were sent. The completions
    share 6 long prefixes: before the kill the router has sent some of them
    to the victim, so after it cache_aware keeps choosing the victim for
    those until the health check or the circuit breaker takes it out (the
    router's retries, meanwhile, must find the other replica)."""
    lock = threading.Lock()
    state: dict[str, object] = {"killed": False}
    in_flight: set[int] = set()
    at_kill: set[int] = set()
    sent_after_kill: list[int] = []
    failed: dict[int, str] = {}

    def one(i: int) -> None:
        with lock:
            if i == kill_after and not state["killed"]:
                at_kill.update(in_flight)
                victim.process.kill()  # type: ignore[union-attr]
                state["killed"] = True
            if state["killed"]:
                sent_after_kill.append(i)
            in_flight.add(i)
        try:
            if i % 3 == 2:
                streamed_chat(router.url, f"After the storm the {story(i, 4)}", max_tokens=24)
            else:
                completion(router.url, shared_prefix(i % 6, "failover") + f"Then {story(i, 2)}", max_tokens=24)
        except Exception as exc:  # noqa: BLE001 - recorded, judged by the caller
            failed[i] = repr(exc)
        finally:
            with lock:
                in_flight.discard(i)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(total)))
    victim.process.wait()  # type: ignore[union-attr]
    lost = [i for i in sent_after_kill if i in failed]
    return FailoverOutcomes(total, failed, at_kill, lost)
