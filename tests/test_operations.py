"""Operating the server: the event loop stays free under abusive requests,
bodies and queues are bounded (413, 429), SIGTERM drains, a dead scheduler
ends the process, and /metrics carries the latency histograms."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RunningServer, start_server

from server_process import free_port

LIMIT = 1_000_000  # --max-request-bytes for the stories server here


@pytest.fixture(scope="module")
def server(stories_path: Path):
    server = start_server(stories_path, "--max-request-bytes", str(LIMIT))
    yield server
    server.stop()


def histograms(url: str) -> dict[str, dict[str, float]]:
    """name -> {"count": n, "sum": s, "le=X": cumulative count}, summed over labels."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.type != "histogram":
            continue
        values = out.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name.endswith("_count"):
                key = "count"
            elif sample.name.endswith("_sum"):
                key = "sum"
            else:
                key = f"le={sample.labels['le']}"
            values[key] = values.get(key, 0.0) + sample.value
    return out


def counters(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in (name, f"{name}_total"):
                out[tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))] = sample.value
    return out


class HealthWatch:
    """Polls /health from a thread; keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.answers, self.failures = url, 0.0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/health", timeout=10).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.perf_counter() - start)
                self.answers += ok
                self.failures += not ok
                time.sleep(0.02)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def lag_over(before: dict[str, float], after: dict[str, float], bound: str) -> tuple[float, float]:
    """Loop-lag observations in the window, and those above `bound` seconds."""
    total = after["count"] - before.get("count", 0)
    within = after[f"le={bound}"] - before.get(f"le={bound}", 0)
    return total, total - within


# -- the loop stays free ------------------------------------------------------------


def test_loop_lag_and_health_under_maximal_requests(server: RunningServer) -> None:
    """The largest body the server takes (a prompt just under
    --max-request-bytes, refused by its length without tokenizing) and the
    longest prompt it serves (the whole context, as token ids, echoed with
    logprobs) keep the loop's lag under 100 ms, and /health answers throughout."""
    lag_name = "aioserve:event_loop_lag_seconds"
    time.sleep(0.3)  # a few timer wakes before the window
    before = histograms(server.url)[lag_name]
    max_len = httpx.get(f"{server.v1}/models", timeout=10).json()["data"][0]["max_model_len"]
    with HealthWatch(server.url) as watch:
        big = json.dumps({"prompt": "hello " * ((LIMIT - 100) // 6), "max_tokens": 5})
        assert len(big) <= LIMIT
        started = time.perf_counter()
        response = httpx.post(f"{server.v1}/completions", content=big, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
        assert "too long" in response.json()["error"]["message"]
        assert time.perf_counter() - started < 5  # refused, not tokenized
        ids = [(i * 7) % 500 + 3 for i in range(max_len - 1)]
        response = httpx.post(
            f"{server.v1}/completions",
            json={"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 5},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["logprobs"]["tokens"]) == max_len
        time.sleep(0.2)
    after = histograms(server.url)[lag_name]
    total, late = lag_over(before, after, "0.1")
    assert total >= 3 and late == 0, (before, after)
    assert watch.answers >= 3 and watch.failures == 0
    assert watch.worst < 1.0  # an HTTP round trip, not a held loop (2 shared cores: generous)


def test_a_prompt_that_fits_is_never_refused_by_its_length(server: RunningServer) -> None:
    """The character bound is a lower bound on tokens: a prompt of the most
    characters that still fits (a long repeated token) goes through."""
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "a" * 2000}, timeout=30).json()["count"]
    max_len = httpx.get(f"{server.v1}/models", timeout=10).json()["data"][0]["max_model_len"]
    chars = 2000 * (max_len - 10) // tokens  # as many characters as fit, in the densest text we have
    response = httpx.post(f"{server.v1}/completions", json={"prompt": "a" * chars, "max_tokens": 1}, timeout=60)
    assert response.status_code == 200, response.text


# -- 413 ------------------------------------------------------------------------------


def test_oversized_body_gets_413_before_it_is_read(server: RunningServer) -> None:
    body = b'{"prompt": "' + b"x" * (LIMIT + 10) + b'", "max_tokens": 1}'
    response = httpx.post(f"{server.v1}/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert "--max-request-bytes" in error["message"]


def test_oversized_chunked_body_gets_413(server: RunningServer) -> None:
    """No Content-Length: counted as it streams in."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT // 65536 + 2):
            yield b"y" * 65536
        yield b'"}'

    response = httpx.post(f"{server.v1}/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


# -- metrics ----------------------------------------------------------------------------


def test_metrics_histograms_move_as_requests_run(server: RunningServer) -> None:
    names = [
        "aioserve:time_to_first_token_seconds",
        "aioserve:inter_token_latency_seconds",
        "aioserve:e2e_request_latency_seconds",
        "aioserve:request_queue_time_seconds",
    ]
    before = histograms(server.url)
    finished_before = counters(server.url, "aioserve:request_success")
    for stream in (False, True):
        response = httpx.post(
            f"{server.v1}/completions", json={"prompt": "Once upon", "max_tokens": 8, "stream": stream}, timeout=60
        )
        assert response.status_code == 200
    after = histograms(server.url)
    for name in names:
        assert after[name]["count"] > before.get(name, {}).get("count", 0), name
    assert after["aioserve:inter_token_latency_seconds"]["count"] - before[
        "aioserve:inter_token_latency_seconds"
    ].get("count", 0) >= 2 * 7
    assert after["aioserve:time_to_first_token_seconds"]["sum"] > before["aioserve:time_to_first_token_seconds"].get(
        "sum", 0
    )
    finished = counters(server.url, "aioserve:request_success")
    key = (("finished_reason", "length"),)
    assert finished[key] - finished_before.get(key, 0) == 2
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("aioserve:prefix_cache_queries", "aioserve:prefix_cache_hits", "aioserve:num_requests_waiting"):
        assert name in text


def test_a_whole_response_times_its_tokens_as_they_were_made(server: RunningServer) -> None:
    """A response that is not streamed reads its events only when it
    finishes (generation.py), but its latency metrics are the tokens' own
    times: its first token came long before its last."""
    before = histograms(server.url)
    response = httpx.post(
        f"{server.v1}/completions",
        json={"prompt": "Once upon", "max_tokens": 200, "ignore_eos": True, "temperature": 0}, timeout=60,
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 200
    after = histograms(server.url)

    def grew(name: str, key: str) -> float:
        return after[name][key] - before.get(name, {}).get(key, 0.0)

    ttft, e2e = grew("aioserve:time_to_first_token_seconds", "sum"), grew("aioserve:e2e_request_latency_seconds", "sum")
    itl = grew("aioserve:inter_token_latency_seconds", "sum")
    assert grew("aioserve:inter_token_latency_seconds", "count") == 199
    assert 0 < ttft < 0.5 * e2e and itl > 0  # read at the end, a token "arriving" then would make ttft ~ e2e
    assert abs(ttft + itl - e2e) < 0.1 * e2e  # first token, then the gaps between the others: the whole


def test_a_whole_response_holds_back_a_bounded_number_of_events() -> None:
    """A whole response's choice (no stop strings) reaches its handler when
    it finishes or HELD_EVENTS events wait, so a long generation's waiting
    events stay few; a stream's, or a choice with stop strings, at once."""
    from aioserve.sampling_params import SamplingParams
    from aioserve.scheduler import RequestEvent
    from aioserve.server.output.generation import HELD_EVENTS, Generation

    def queued(incremental: bool, params: SamplingParams, tokens: int, finish: bool) -> int:
        generation = Generation(ctx=None, request_id="x", incremental=incremental)  # type: ignore[arg-type]
        sink = generation._sink(lambda: None, params)  # type: ignore[arg-type,return-value]
        for i in range(tokens):
            sink(RequestEvent(token_id=i, logprob=0.0))
        if finish:
            sink(RequestEvent(finish_reason="length"))
        return generation._queue.qsize()

    whole = SamplingParams(max_tokens=1000)
    assert queued(False, whole, HELD_EVENTS - 1, finish=False) == 0
    assert queued(False, whole, 2 * HELD_EVENTS + 5, finish=False) == 2 * HELD_EVENTS
    assert queued(False, whole, 2 * HELD_EVENTS + 5, finish=True) == 2 * HELD_EVENTS + 6
    assert queued(True, whole, 5, finish=False) == 5
    assert queued(False, SamplingParams(max_tokens=1000, stop=["."]), 5, finish=False) == 5


def test_errors_are_counted_by_type(server: RunningServer) -> None:
    key = (("error_type", "invalid_request_error"), ("status", "400"))
    before = counters(server.url, "aioserve:request_errors").get(key, 0)
    httpx.post(f"{server.v1}/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert counters(server.url, "aioserve:request_errors")[key] == before + 1


def test_unknown_fields_are_accepted_and_logged_once(server: RunningServer) -> None:
    for _ in range(3):
        response = httpx.post(
            f"{server.v1}/completions",
            json={"prompt": "Once", "max_tokens": 1, "vendor_extra_knob": {"a": 1}},
            timeout=30,
        )
        assert response.status_code == 200
    log = server.log()
    assert log.count("'vendor_extra_knob'") == 1, log[-2000:]


# -- 429 -------------------------------------------------------------------------------


def test_full_queue_gets_429_with_retry_after(wide_model: Path) -> None:
    server = start_server(
        wide_model, "--load-format", "dummy", "--device", "cpu", "--max-running-requests", "1",
        "--max-waiting-requests", "1",
    )
    try:
        body = {"prompt": [5] * 8, "max_tokens": 120, "ignore_eos": True}
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(httpx.post(f"{server.v1}/completions", json=body, timeout=300).status_code))
            for _ in range(2)
        ]
        # One after the other: started together, the second could arrive (on a
        # loaded machine) only once the first had finished, and never wait.
        deadline = time.monotonic() + 60
        for thread, (state, count) in zip(threads, (("running", 1), ("waiting", 1))):  # one runs, one waits
            thread.start()
            while server.info()[state] < count:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        started = time.perf_counter()
        response = httpx.post(f"{server.v1}/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert time.perf_counter() - started < 5  # at once, not after the queue moves
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"
        assert "--max-waiting-requests" in error["message"]
        for thread in threads:
            thread.join()
        assert results == [200, 200]  # the queued ones are served
    finally:
        server.stop()


# -- graceful shutdown -------------------------------------------------------------


def _stream_in_thread(url: str, body: dict, events: list[dict], started: threading.Event) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started.set()
                    elif line == "data: [DONE]":
                        events.append({"done": True})
        except httpx.HTTPError as exc:  # the server exited mid-stream (the second-signal test)
            events.append({"broken": repr(exc)})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigterm_drains_running_streams_and_exits_0(wide_model: Path) -> None:
    server = start_server(wide_model, "--load-format", "dummy", "--device", "cpu")
    events: list[dict] = []
    started = threading.Event()
    body = {"prompt": [5] * 8, "max_tokens": 120, "ignore_eos": True, "stream_options": {"include_usage": True}}
    thread = _stream_in_thread(server.url, body, events, started)
    assert started.wait(60)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    response = httpx.post(f"{server.v1}/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
    assert response.headers["retry-after"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    thread.join(120)
    assert server.process.wait(60) == 0
    assert events[-1] == {"done": True}
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]  # ran to its end
    assert events[-2]["usage"]["completion_tokens"] == 120


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(wide_model: Path) -> None:
    server = start_server(wide_model, "--load-format", "dummy", "--device", "cpu", "--shutdown-timeout", "0.5")
    events: list[dict] = []
    started = threading.Event()
    thread = _stream_in_thread(server.url, {"prompt": [5] * 8, "max_tokens": 3000, "ignore_eos": True}, events, started)
    assert started.wait(60)
    server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert server.process.wait(60) == 0
    assert events[-1] == {"done": True}
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]  # cut short ("abort" is not OpenAI's); its final event came before the listener closed


def test_second_signal_exits_at_once(wide_model: Path) -> None:
    server = start_server(wide_model, "--load-format", "dummy", "--device", "cpu", "--shutdown-timeout", "300")
    events: list[dict] = []
    started = threading.Event()
    _stream_in_thread(server.url, {"prompt": [5] * 8, "max_tokens": 3000, "ignore_eos": True}, events, started)
    assert started.wait(60)
    server.process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(10) == 128 + signal.SIGINT


# -- a dead scheduler ends the process ---------------------------------------------------

DYING_SERVER = """
import asyncio, sys
from aioserve.scheduler.scheduler import Scheduler

async def dying_run(self, until_idle=False):
    await asyncio.sleep(1.5)
    raise RuntimeError("injected: the scheduler loop dies")

Scheduler.run = dying_run
from aioserve.cli import main
sys.argv = ["aioserve", "serve", "--model", {model!r}, "--port", "{port}"]
main()
"""


def test_scheduler_death_fails_health_and_exits_nonzero(stories_path: Path, tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "dying.py"
    script.write_text(textwrap.dedent(DYING_SERVER).format(model=str(stories_path), port=port))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        statuses = []
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        code = process.wait(15)
        output = process.stdout.read() if process.stdout else ""
    finally:
        process.kill()
    assert code != 0, output[-3000:]
    assert 200 in statuses and statuses[-1] == 503, statuses
    assert "the scheduler loop died" in output


# -- fault containment in the chat path ------------------------------------------------


def test_chat_template_kwargs_may_set_add_generation_prompt(chat_server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    counts = {}
    for flag in (True, False):
        response = httpx.post(
            f"{chat_server.v1}/chat/completions",
            json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": flag}},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        counts[flag] = response.json()["usage"]["prompt_tokens"]
    assert counts[True] > counts[False]  # '<|im_start|>assistant\n' appended only when asked
    response = httpx.post(
        f"{chat_server.v1}/chat/completions",
        json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"tokenize": True}},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


RAISING_TEMPLATE = (
    "{% if messages[0]['content'] == 'refuse' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% for m in messages %}{{ m['content'] + (m['content'] | length) }}{% endfor %}"
)


def test_a_template_that_raises_fails_only_its_request(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """raise_exception (the template refusing the messages) is the client's
    400; a template that breaks (str + int) is a 500 in the error shape; and
    the server goes on serving."""
    template = tmp_path / "broken.jinja"
    template.write_text(RAISING_TEMPLATE)
    server = start_server(tiny_checkpoints["llama"], "--chat-template", str(template))
    try:
        url = f"{server.v1}/chat/completions"
        refused = httpx.post(url, json={"messages": [{"role": "user", "content": "refuse"}]}, timeout=60)
        assert refused.status_code == 400 and "roles must alternate" in refused.json()["error"]["message"]
        broken = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=60)
        assert broken.status_code == 500
        assert broken.json()["error"]["type"] == "internal_server_error"
        fine = httpx.post(f"{server.v1}/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert fine.status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
