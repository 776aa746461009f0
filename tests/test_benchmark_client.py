"""Tests for benchmarks/serving.py against a stub OpenAI-compatible server.

The stub streams a known number of tokens with known delays, so the client's
counts must match exactly and its timings must land near the stub's delays.
Everything runs on CPU over loopback; async code runs through asyncio.run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"


def _load_bench_module() -> Any:
    # Load by path: benchmarks/ is not a package and the test must not depend
    # on sys.path order (the script is also checked as a subprocess below).
    spec = importlib.util.spec_from_file_location("serving_bench_under_test", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


bench = _load_bench_module()

MODEL_ID = "stub-model"
FIRST_DELAY = 0.05  # stub "prefill" before the first token
TOKEN_DELAY = 0.02  # stub gap between chunks


# --------------------------------------------------------------------------
# Stub server
# --------------------------------------------------------------------------


@dataclass
class StubState:
    first_delay: float = FIRST_DELAY
    token_delay: float = TOKEN_DELAY
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail_every: int = 0  # every k-th request (1-based) answers HTTP 500
    request_count: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    # A stream waits (up to 5 s) until this many have been in flight at once:
    # a concurrency test then does not hang on the client reaching its cap
    # before the first request ends, which a loaded machine may not allow.
    hold_until_peak: int = 0
    payloads: list[dict[str, Any]] = field(default_factory=list)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(chat: bool, text: Optional[str], finish: Optional[str], role: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": "c", "object": "chat.completion.chunk", "model": MODEL_ID, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return {"id": "c", "object": "text_completion", "model": MODEL_ID, "choices": [choice]}


def build_stub_app(state: StubState) -> Starlette:
    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    async def generate(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        payload = await request.json()
        state.payloads.append(payload)
        state.request_count += 1
        if state.fail_every and state.request_count % state.fail_every == 0:
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=500)
        n_tokens = int(payload["max_tokens"])
        prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def stream() -> Any:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                waited = 0.0
                while state.max_in_flight < state.hold_until_peak and waited < 5.0:
                    await asyncio.sleep(0.01)
                    waited += 0.01
                if chat:  # real servers open with an empty role delta; it is not a token
                    yield _sse(_chunk(chat, None, None, role=True))
                await asyncio.sleep(state.first_delay)
                sent = 0
                while sent < n_tokens:
                    if sent:
                        await asyncio.sleep(state.token_delay)
                    k = min(state.tokens_per_chunk, n_tokens - sent)
                    yield _sse(_chunk(chat, " tok" * k, None))
                    sent += k
                yield _sse(_chunk(chat, None, "length"))
                if state.send_usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                             "total_tokens": prompt_tokens + n_tokens}
                    yield _sse({"id": "c", "model": MODEL_ID, "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
    ])


class StubServer:
    """Hypercorn serving the stub app on a free loopback port in a thread."""

    def __init__(self) -> None:
        self.state = StubState()
        self._loop = asyncio.new_event_loop()
        self._stop: Optional[asyncio.Event] = None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # bound here so the port is known and never raced
        self.port = sock.getsockname()[1]
        self._fd = sock.detach()  # hypercorn takes ownership via fd://
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        config = HypercornConfig()
        config.bind = [f"fd://{self._fd}"]
        config.accesslog = None
        config.errorlog = None
        config.graceful_timeout = 0.5
        try:
            self._loop.run_until_complete(serve(build_stub_app(self.state), config, shutdown_trigger=self._stop.wait))
        finally:
            self._loop.close()  # releases the loop's self-pipe sockets

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("stub server did not start")

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5)

    def reset(self) -> StubState:
        # Mutated in place: the running app holds a reference to this object.
        fresh = StubState()
        self.state.__dict__.update(fresh.__dict__)
        return self.state


@pytest.fixture(scope="module")
def stub_server() -> Iterator[StubServer]:
    server = StubServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def stub(stub_server: StubServer) -> StubServer:
    stub_server.reset()
    return stub_server


def run(config: Any) -> Any:
    return asyncio.run(bench.run_benchmark(config))


def make_config(stub: StubServer, **overrides: Any) -> Any:
    defaults: dict[str, Any] = dict(base_url=stub.url, num_requests=6, input_len=16, output_len=5,
                                    warmup=0, progress=False, timeout=30.0)
    defaults.update(overrides)
    return bench.BenchConfig(**defaults)


# --------------------------------------------------------------------------
# End-to-end against the stub
# --------------------------------------------------------------------------


def test_completions_counts_and_latencies(stub: StubServer) -> None:
    result = run(make_config(stub, num_requests=8, warmup=1))
    s = result.summary

    assert result.model == MODEL_ID  # resolved from GET /v1/models
    assert (s["completed"], s["failed"]) == (8, 0)
    assert len(stub.state.payloads) == 9  # the warm-up request reached the server
    for rec in result.records:
        assert rec.success and rec.error is None
        assert rec.usage_reported and rec.completion_tokens == 5
        assert len(rec.chunk_times) == 5 and rec.finish_reason == "length"
        assert rec.prompt_tokens == 16
    assert s["total_output_tokens"] == 40 and s["total_input_tokens"] == 128

    # No upper bounds on latencies (a loaded 2-core machine stretches them
    # without limit). What holds at any speed: each record's stamps are in
    # order, the stub's sleeps are lower bounds (the clock starts before the
    # request leaves), and the summary is the percentiles of the records.
    for rec in result.records:
        stamps = [rec.send_time, *rec.chunk_times, rec.end_time]
        assert stamps == sorted(stamps)
        assert rec.ttft >= FIRST_DELAY * 0.9
        assert rec.e2e >= (FIRST_DELAY + 4 * TOKEN_DELAY) * 0.9
    ttfts = [r.ttft * 1000 for r in result.records]
    itls = [gap * 1000 for r in result.records for gap in r.itls]
    e2es = [r.e2e * 1000 for r in result.records]
    tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1) * 1000 for r in result.records]
    for name, values in (("ttft_ms", ttfts), ("itl_ms", itls), ("e2e_ms", e2es), ("tpot_ms", tpots)):
        assert s[name]["p50"] == pytest.approx(float(np.percentile(values, 50)))
        assert s[name]["mean"] == pytest.approx(float(np.mean(values)))
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
    assert s["output_throughput"] == pytest.approx(40 / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(8 / s["duration_s"])

    payload = stub.state.payloads[-1]
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["ignore_eos"] is True and payload["temperature"] == 0 and payload["max_tokens"] == 5
    assert len(payload["prompt"]) == 16 and all(100 <= t < 500 for t in payload["prompt"])


def test_chat_endpoint_skips_role_chunk(stub: StubServer) -> None:
    result = run(make_config(stub, endpoint="chat", num_requests=4, model="explicit", ignore_eos=False))
    s = result.summary
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 0, 20)
    assert result.model == "explicit"
    # The immediate empty role chunk must not count as the first token: every
    # TTFT includes the stub's sleep before its first token (a lower bound,
    # so no machine is too slow for it).
    assert all(r.ttft >= FIRST_DELAY * 0.9 for r in result.records)
    assert all(len(r.chunk_times) == 5 for r in result.records)
    payload = stub.state.payloads[0]
    assert isinstance(payload["messages"][0]["content"], str)
    assert len(payload["messages"][0]["content"].split()) == 16  # filler words
    assert "ignore_eos" not in payload


def test_packed_chunks_use_usage_counts(stub: StubServer) -> None:
    stub.state.tokens_per_chunk = 2
    result = run(make_config(stub, num_requests=3, output_len=6))
    for rec in result.records:
        assert rec.completion_tokens == 6  # from usage, not the 3 chunks
        assert len(rec.chunk_times) == 3 and len(rec.itls) == 2
    assert result.summary["total_output_tokens"] == 18


def test_missing_usage_falls_back_to_chunk_count(stub: StubServer) -> None:
    stub.state.send_usage = False
    result = run(make_config(stub, num_requests=3, output_len=4))
    assert result.summary["completed"] == 3
    for rec in result.records:
        assert not rec.usage_reported and rec.completion_tokens == 4
        assert rec.prompt_tokens is None and rec.input_tokens == 16  # client-side count


def test_failed_requests_are_counted(stub: StubServer) -> None:
    stub.state.fail_every = 3
    result = run(make_config(stub, num_requests=9))
    s = result.summary
    assert (s["completed"], s["failed"]) == (6, 3)
    failed = [r for r in result.records if not r.success]
    assert all(r.status_code == 500 and "HTTP 500" in (r.error or "") for r in failed)
    assert all(r.ttft is None and r.e2e is None for r in failed)
    assert s["total_output_tokens"] == 30  # failures contribute nothing


def test_connection_error_is_a_failure_not_a_crash(stub: StubServer) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]  # nothing listens here once closed
    result = run(make_config(stub, base_url=f"http://127.0.0.1:{dead_port}", model="m", num_requests=2))
    assert (result.summary["completed"], result.summary["failed"]) == (0, 2)
    assert all(r.error for r in result.records)
    assert result.summary["ttft_ms"]["p50"] is None


def test_request_rate_spreads_sends(stub: StubServer) -> None:
    n, rate, seed = 20, 40.0, 3
    result = run(make_config(stub, num_requests=n, request_rate=rate, output_len=2, seed=seed))
    assert result.summary["completed"] == n
    # The schedule is the seed's (run_benchmark's second spawned stream), so it
    # is known exactly; a sleep never ends early, so no request goes out before
    # its offset, and they go out in schedule order. Lateness is not bounded:
    # a loaded machine may delay any send.
    arrival_stream = np.random.SeedSequence(seed).spawn(3)[1]
    offsets = bench.arrival_offsets(n, rate, np.random.default_rng(arrival_stream))
    by_index = sorted(result.records, key=lambda r: r.index)
    assert all(r.send_time >= offset - 1e-3 for r, offset in zip(by_index, offsets))
    assert [r.send_time for r in by_index] == sorted(r.send_time for r in by_index)
    assert offsets[-1] > 0.35 * (n - 1) / rate  # the schedule itself is spread out, not a burst

    # Rate inf: every request goes out before any answer is back (all tasks
    # start in one turn of the loop, before it reads a single response).
    burst = run(make_config(stub, num_requests=n, output_len=2))
    assert max(r.send_time for r in burst.records) < min(r.chunk_times[0] for r in burst.records)


def test_max_concurrency_caps_in_flight(stub: StubServer) -> None:
    stub.state.hold_until_peak = 2
    result = run(make_config(stub, num_requests=6, max_concurrency=2))
    assert result.summary["completed"] == 6
    assert stub.state.max_in_flight == 2
    one_request = FIRST_DELAY + 4 * TOKEN_DELAY
    assert result.duration >= 3 * one_request * 0.9  # three waves of two


def test_shared_prefixes(stub: StubServer) -> None:
    cfg = make_config(stub, num_requests=10, shared_prefix_len=12, num_prefixes=2, input_len=4, seed=1)
    result = run(cfg)
    assert result.summary["completed"] == 10
    prompts = [p["prompt"] for p in stub.state.payloads]
    assert all(len(p) == 16 for p in prompts)
    assert len({tuple(p[:12]) for p in prompts}) == 2
    assert len({tuple(p[12:]) for p in prompts}) == 10
    assert all(r.prompt_len == 16 for r in result.records)


def test_random_lengths_and_seed(stub: StubServer) -> None:
    cfg = make_config(stub, num_requests=8, random_input_len=(3, 9), random_output_len=(1, 4), seed=7)
    result = run(cfg)
    first_prompts = [p["prompt"] for p in stub.state.payloads]
    for rec in result.records:
        assert 3 <= rec.prompt_len <= 9 and 1 <= rec.max_tokens <= 4
        assert rec.completion_tokens == rec.max_tokens
    assert len({r.max_tokens for r in result.records}) > 1

    stub.reset()
    run(cfg)  # same seed, same prompts
    key = lambda p: json.dumps(p)  # noqa: E731 - arrival order may differ
    assert sorted(map(key, first_prompts)) == sorted(key(p["prompt"]) for p in stub.state.payloads)


# --------------------------------------------------------------------------
# Tokenizer-based prompts
# --------------------------------------------------------------------------


def _word_level_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[BOS]"] + [f"w{i}" for i in range(600)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[BOS]"])
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def _byte_level_bpe_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog " * 3, "serving large language models fast " * 3,
              "tokens per second and time to first token " * 3]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"]))
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_tokenizer_text_prompts_have_exact_length(stub: StubServer, tmp_path: Path) -> None:
    tok_file = _word_level_tokenizer(tmp_path)
    cfg = make_config(stub, endpoint="chat", num_requests=4, input_len=24, tokenizer=str(tmp_path))
    result = run(cfg)
    tok = bench.load_tokenizer(str(tok_file))
    for payload in stub.state.payloads:
        text = payload["messages"][0]["content"]
        assert len(tok.encode(text, add_special_tokens=False).ids) == 24
        assert "[BOS]" not in text  # special tokens are never sampled
    assert all(r.prompt_len == 24 for r in result.records)


def test_exact_length_repair_with_byte_level_bpe(tmp_path: Path) -> None:
    import numpy as np

    tok = bench.load_tokenizer(str(_byte_level_bpe_tokenizer(tmp_path)))
    cfg = bench.BenchConfig(tokenizer=str(tmp_path), vocab_low=0)
    pool = bench._token_pool(cfg, tok)
    rng = np.random.default_rng(0)
    for n in (1, 7, 32, 100):
        text, count = bench._text_with_exact_tokens(tok, n, rng, pool)
        assert count == n == len(tok.encode(text, add_special_tokens=False).ids)


def test_tokenizer_with_prompts_as_ids(stub: StubServer, tmp_path: Path) -> None:
    _word_level_tokenizer(tmp_path)
    cfg = make_config(stub, num_requests=2, input_len=10, tokenizer=str(tmp_path / "tokenizer.json"),
                      prompts_as_ids=True, vocab_low=0)
    run(cfg)
    for payload in stub.state.payloads:
        assert len(payload["prompt"]) == 10
        assert 1 not in payload["prompt"]  # id of the added [BOS] token


def test_invalid_configs_are_rejected() -> None:
    with pytest.raises(ValueError):
        bench.validate_config(bench.BenchConfig(endpoint="chat", prompts_as_ids=True))
    with pytest.raises(ValueError):
        bench.validate_config(bench.BenchConfig(request_rate=0))
    with pytest.raises(ValueError):
        bench.validate_config(bench.BenchConfig(random_input_len=(5, 2)))


# --------------------------------------------------------------------------
# Pure metric code
# --------------------------------------------------------------------------


def _record(index: int, send: float, chunks: list[float], end: float, out: int,
            prompt: Optional[int], prompt_len: int = 0) -> Any:
    return bench.RequestRecord(index=index, prompt_len=prompt_len, max_tokens=out, send_time=send, end_time=end,
                               chunk_times=chunks, prompt_tokens=prompt, completion_tokens=out,
                               usage_reported=prompt is not None, success=True)


def test_summarize_exact_percentiles() -> None:
    records = [
        _record(0, 0.0, [0.010, 0.030, 0.070], 0.080, out=3, prompt=10),  # ttft 10, itl 20/40, e2e 80, tpot 35
        _record(1, 1.0, [1.020, 1.030], 1.040, out=2, prompt=20),  # ttft 20, itl 10, e2e 40, tpot 20
        _record(2, 2.0, [2.030], 2.030, out=1, prompt=None, prompt_len=5),  # ttft 30, e2e 30, no tpot
        bench.RequestRecord(index=3, prompt_len=7, max_tokens=4, send_time=0.5, end_time=0.6,
                            chunk_times=[0.55], success=False, error="HTTP 500"),
    ]
    s = bench.summarize(records, duration=4.0)
    approx = lambda v: pytest.approx(v, abs=1e-6)  # noqa: E731

    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 6)
    assert s["duration_s"] == 4.0
    assert s["request_throughput"] == approx(0.75)
    assert s["output_throughput"] == approx(1.5)
    assert s["total_token_throughput"] == approx(10.25)
    # numpy linear interpolation: p90 of [a, b, c] = b + 0.8 (c - b), p99 = b + 0.98 (c - b)
    assert s["ttft_ms"] == {"mean": approx(20), "p50": approx(20), "p90": approx(28), "p99": approx(29.8)}
    assert s["itl_ms"] == {"mean": approx(70 / 3), "p50": approx(20), "p90": approx(36), "p99": approx(39.6)}
    assert s["e2e_ms"] == {"mean": approx(50), "p50": approx(40), "p90": approx(72), "p99": approx(79.2)}
    assert s["tpot_ms"] == {"mean": approx(27.5), "p50": approx(27.5), "p90": approx(33.5), "p99": approx(34.85)}

    table = bench.format_table(s, "hand-made")
    assert "hand-made" in table
    lines = table.splitlines()
    ttft_row = next(line for line in lines if line.startswith("TTFT"))
    assert ttft_row.split()[1:] == ["20.00", "20.00", "28.00", "29.80"]
    assert len({len(line) for line in lines}) == 1  # fixed width


def test_summarize_empty() -> None:
    s = bench.summarize([], duration=0.0)
    assert (s["completed"], s["failed"], s["request_throughput"]) == (0, 0, 0.0)
    assert s["itl_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert "n/a" in bench.format_table(s, "")


def test_arrival_offsets() -> None:
    import numpy as np

    assert bench.arrival_offsets(5, math.inf, np.random.default_rng(0)).tolist() == [0.0] * 5
    offsets = bench.arrival_offsets(2000, 100.0, np.random.default_rng(0))
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    assert np.diff(offsets).mean() == pytest.approx(0.01, rel=0.1)  # exponential gaps, mean 1/rate


# --------------------------------------------------------------------------
# Script entry point
# --------------------------------------------------------------------------


def test_help_subprocess() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--request-rate", "--max-concurrency", "--tokenizer", "--shared-prefix-len", "--no-ignore-eos"):
        assert flag in proc.stdout


def test_cli_end_to_end_writes_json_and_plot(stub: StubServer, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "res.json", tmp_path / "res.png"
    cmd = [sys.executable, str(SCRIPT), "--base-url", stub.url, "-n", "4", "--output-len", "3", "--input-len", "8",
           "--no-progress", "--label", "cli-run", "--json", str(out_json), "--plot", str(out_png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "cli-run" in proc.stdout and "TTFT" in proc.stdout
    data = json.loads(out_json.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert data["summary"]["completed"] == 4 and len(data["records"]) == 4
    assert data["config"]["request_rate"] == "inf" and data["model"] == MODEL_ID
    assert data["table"] in proc.stdout
    assert out_png.stat().st_size > 0
