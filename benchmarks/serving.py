#!/usr/bin/env python3
"""Streaming load generator for any OpenAI-compatible inference server.

Sends ``--num-requests`` streamed requests to ``/v1/completions`` or
``/v1/chat/completions``, timestamps every text-bearing SSE chunk and reports
TTFT, TPOT, ITL and end-to-end latency (mean/p50/p90/p99, ms) together with
request and token throughput.

Examples::

    python benchmarks/serving.py -n 200 --input-len 512 --output-len 128
    python benchmarks/serving.py --request-rate 8 --max-concurrency 32 \\
        --tokenizer /models/llama --endpoint chat --json out.json --plot out.png
    python benchmarks/serving.py --shared-prefix-len 1024 --num-prefixes 4 \\
        --input-len 64 --output-len 32 --label prefix-cache

The module deliberately does not import ``aioserve``: it must measure other
servers the same way.  Other scripts reuse it with::

    sys.path.insert(0, os.path.dirname(__file__))
    from serving import BenchConfig, run_benchmark, format_table
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, Union

import httpx
import numpy as np

logger = logging.getLogger("serving_benchmark")

Prompt = Union[str, list[int]]

# Filler vocabulary for text prompts when no tokenizer is available.  Short,
# common English words are (almost always) one token each in BPE vocabularies,
# so word count is a fair approximation of the prompt's token count.
_FILLER_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was",
    "with", "be", "by", "on", "not", "he", "this", "are", "or", "his", "from",
    "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more",
    "when", "will", "would", "who", "so", "no", "time", "about", "many",
    "then", "them", "some", "new", "people", "like", "what", "into", "water",
    "day", "over", "also", "after", "year", "work", "world", "life", "book",
    "city", "house", "river", "light", "music", "story", "game", "blue",
)

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")
_METRIC_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency"}
_STAT_KEYS: tuple[str, ...] = ("mean", "p50", "p90", "p99")


# --------------------------------------------------------------------------
# Data classes
# --------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """Everything that defines one benchmark run (mirrors the CLI flags)."""

    base_url: str = "http://127.0.0.1:8000"
    model: Optional[str] = None  # None: first id listed by GET /v1/models
    endpoint: str = "completions"  # "completions" or "chat"
    num_requests: int = 100
    request_rate: float = math.inf  # req/s, Poisson arrivals; inf = all at once
    max_concurrency: Optional[int] = None
    input_len: int = 128
    output_len: int = 128
    random_input_len: Optional[tuple[int, int]] = None  # inclusive [lo, hi]
    random_output_len: Optional[tuple[int, int]] = None  # inclusive [lo, hi]
    seed: int = 0
    tokenizer: Optional[str] = None  # folder with tokenizer.json, or the file
    prompts_as_ids: bool = False
    vocab_low: int = 100
    vocab_high: Optional[int] = None  # exclusive; None: 500, or vocab size with a tokenizer
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    ignore_eos: bool = True
    temperature: float = 0.0
    warmup: int = 1
    timeout: float = 600.0  # per request, whole stream included
    api_key: Optional[str] = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    progress: bool = True


@dataclass
class RequestSpec:
    """One prepared request: the prompt and the lengths we asked for."""

    prompt: Prompt
    prompt_len: int  # client-side token count (exact with ids or a tokenizer)
    output_len: int  # max_tokens sent


@dataclass
class RequestRecord:
    """What happened to one request.  Times are seconds since benchmark start."""

    index: int
    prompt_len: int
    max_tokens: int
    send_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # text-bearing chunks only
    prompt_tokens: Optional[int] = None  # from the usage chunk
    completion_tokens: Optional[int] = None  # from usage, else counted
    usage_reported: bool = False
    success: bool = False
    error: Optional[str] = None
    status_code: Optional[int] = None
    finish_reason: Optional[str] = None

    @property
    def ttft(self) -> Optional[float]:
        if not self.success or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> Optional[float]:
        return self.end_time - self.send_time if self.success else None

    @property
    def itls(self) -> list[float]:
        # Per chunk, not per token: a server may pack several tokens per chunk.
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens or 0

    @property
    def tpot(self) -> Optional[float]:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens <= 1:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return out


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    duration: float  # seconds from first send to last completion
    summary: dict[str, Any]
    records: list[RequestRecord]

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label,
            "model": self.model,
            "config": asdict(self.config),
            "summary": self.summary,
            "table": format_table(self.summary, self.config.label),
            "records": [r.to_dict() for r in self.records],
        }


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


def _stats_ms(values_s: Sequence[float]) -> dict[str, Optional[float]]:
    """mean/p50/p90/p99 in milliseconds; None when there is nothing to measure."""
    if len(values_s) == 0:
        return {k: None for k in _STAT_KEYS}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])  # linear interpolation
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """Aggregate per-request records into the benchmark's metrics.

    Latency figures use successful requests only.  Keys: duration_s,
    completed, failed, total_input_tokens, total_output_tokens,
    request_throughput, output_throughput, total_token_throughput and
    ttft_ms / tpot_ms / itl_ms / e2e_ms, each {mean, p50, p90, p99}.
    """
    ok = [r for r in records if r.success]
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_sec = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
    }
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_sec(len(ok)),
        "output_throughput": per_sec(total_out),
        "total_token_throughput": per_sec(total_in + total_out),
    }
    for name in LATENCY_METRICS:
        summary[f"{name}_ms"] = _stats_ms(samples[name])
    return summary


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict[str, Any], label: str = "") -> str:
    """Fixed-width, one-row-per-metric rendering of ``summarize``'s output."""
    width = 62
    title = f" Serving benchmark{': ' + label if label else ''} "
    scalars = [
        ("Successful requests", str(summary["completed"])),
        ("Failed requests", str(summary["failed"])),
        ("Duration (s)", _fmt(summary["duration_s"])),
        ("Total input tokens", str(summary["total_input_tokens"])),
        ("Total output tokens", str(summary["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(summary["request_throughput"])),
        ("Output token throughput (tok/s)", _fmt(summary["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(summary["total_token_throughput"])),
    ]
    lines = [title.center(width, "=")]
    lines += [f"{name:<40}{value:>22}" for name, value in scalars]
    lines.append("-" * width)
    lines.append(f"{'Latency (ms)':<22}" + "".join(f"{k:>10}" for k in _STAT_KEYS))
    for name in LATENCY_METRICS:
        stats = summary[f"{name}_ms"]
        lines.append(f"{_METRIC_TITLES[name]:<22}" + "".join(f"{_fmt(stats[k]):>10}" for k in _STAT_KEYS))
    lines.append("=" * width)
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Prompt generation
# --------------------------------------------------------------------------


def load_tokenizer(path: str) -> Any:
    """Load a ``tokenizers.Tokenizer`` from tokenizer.json or a folder holding one."""
    from tokenizers import Tokenizer  # imported lazily: only needed with --tokenizer

    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(path)


def _token_pool(config: BenchConfig, tokenizer: Any) -> np.ndarray:
    """Token ids prompts are drawn from: a safe range without special tokens."""
    if tokenizer is None:
        high = config.vocab_high if config.vocab_high is not None else 500
        special: set[int] = set()
    else:
        base = tokenizer.get_vocab_size(with_added_tokens=False)
        high = min(config.vocab_high, base) if config.vocab_high is not None else base
        # Added tokens (BOS/EOS, chat markers) would distort prompts and lengths.
        special = set(tokenizer.get_added_tokens_decoder().keys())
    pool = np.array([i for i in range(config.vocab_low, high) if i not in special], dtype=np.int64)
    if pool.size == 0:
        raise ValueError(f"empty token range [{config.vocab_low}, {high})")
    return pool


def _text_with_exact_tokens(tokenizer: Any, n: int, rng: np.random.Generator, pool: np.ndarray) -> tuple[str, int]:
    """Random text that re-encodes to exactly ``n`` tokens (best effort).

    Decoding random ids and encoding the text again rarely round-trips
    (merges, partial bytes), so repair the id list until the count is stable.
    """
    if n <= 0:
        return "", 0
    ids = rng.choice(pool, n).tolist()
    text, count = "", 0
    for _ in range(16):
        text = tokenizer.decode(ids)
        enc = tokenizer.encode(text, add_special_tokens=False).ids
        count = len(enc)
        if count == n:
            break
        ids = enc[:n] if count > n else enc + rng.choice(pool, n - count).tolist()
    else:
        logger.debug("prompt of %d tokens re-encodes to %d", n, count)
    return text, count


class PromptFactory:
    """Builds prompts in one of three modes: token ids, tokenizer text, filler words."""

    def __init__(self, config: BenchConfig, tokenizer: Any, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.use_ids = config.prompts_as_ids or (tokenizer is None and config.endpoint == "completions")
        self.pool = _token_pool(config, tokenizer)
        self.prefixes: list[tuple[Prompt, int]] = [
            self.random_prompt(config.shared_prefix_len)
            for _ in range(config.num_prefixes if config.shared_prefix_len > 0 else 0)
        ]

    def random_prompt(self, n: int) -> tuple[Prompt, int]:
        if self.use_ids:
            return self.rng.choice(self.pool, n).tolist(), n
        if self.tokenizer is not None:
            return _text_with_exact_tokens(self.tokenizer, n, self.rng, self.pool)
        words = self.rng.choice(len(_FILLER_WORDS), n)
        return " ".join(_FILLER_WORDS[i] for i in words), n

    def make(self, input_len: int) -> tuple[Prompt, int]:
        """A prompt of ``input_len`` tokens, after a shared prefix if configured."""
        suffix, suffix_len = self.random_prompt(input_len)
        if not self.prefixes:
            return suffix, suffix_len
        prefix, prefix_len = self.prefixes[int(self.rng.integers(len(self.prefixes)))]
        if self.use_ids:
            return list(prefix) + list(suffix), prefix_len + suffix_len
        if self.tokenizer is None:
            return f"{prefix} {suffix}".strip(), prefix_len + suffix_len
        text = str(prefix) + str(suffix)
        # Merges across the seam can change the count; report what the server sees.
        return text, len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def _draw_lengths(fixed: int, rand: Optional[tuple[int, int]], n: int, rng: np.random.Generator) -> list[int]:
    if rand is None:
        return [fixed] * n
    lo, hi = rand
    return rng.integers(lo, hi + 1, size=n).tolist()


def build_requests(config: BenchConfig, tokenizer: Any, rng: np.random.Generator, n: int) -> list[RequestSpec]:
    factory = PromptFactory(config, tokenizer, rng)
    in_lens = _draw_lengths(config.input_len, config.random_input_len, n, rng)
    out_lens = _draw_lengths(config.output_len, config.random_output_len, n, rng)
    specs = []
    for in_len, out_len in zip(in_lens, out_lens):
        prompt, prompt_len = factory.make(in_len)
        specs.append(RequestSpec(prompt=prompt, prompt_len=prompt_len, output_len=out_len))
    return specs


def arrival_offsets(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s) for a Poisson process of ``rate``; all zero when rate is inf."""
    if n == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / rate, size=n)
    # The first request goes out at t=0, so n requests span about (n-1)/rate.
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


# --------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def endpoint_url(config: BenchConfig) -> str:
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    return _api_root(config.base_url) + path


def make_payload(config: BenchConfig, model: str, spec: RequestSpec) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    if config.ignore_eos:
        payload["ignore_eos"] = True  # non-standard, but fixes output lengths
    payload.update(config.extra_body)
    return payload


def make_client(config: BenchConfig) -> httpx.AsyncClient:
    # One connection per in-flight request: a pool that is too small would
    # queue requests in the client and inflate TTFT.
    conns = max(config.max_concurrency or config.num_requests, 1) + 8
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    return httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout, pool=None),
        limits=httpx.Limits(max_connections=conns, max_keepalive_connections=conns),
        headers=headers,
    )


async def fetch_first_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(_api_root(base_url) + "/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models")
    return str(models[0]["id"])


def _chunk_text(obj: dict[str, Any], chat: bool) -> tuple[str, Optional[str]]:
    """(text, finish_reason) carried by one stream chunk."""
    choices = obj.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return text or "", choice.get("finish_reason")


async def _consume_stream(resp: httpx.Response, record: RequestRecord, t0: float, chat: bool) -> str:
    """Read SSE lines into ``record``; returns the generated text."""
    parts: list[str] = []
    done = False
    async for line in resp.aiter_lines():
        now = time.perf_counter() - t0  # stamp before parsing: parsing is client cost
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if obj.get("error"):
            raise RuntimeError(f"error in stream: {obj['error']}")
        text, finish = _chunk_text(obj, chat)
        if text:
            record.chunk_times.append(now)
            parts.append(text)
        if finish:
            record.finish_reason = finish
        usage = obj.get("usage")
        if usage:
            record.usage_reported = True
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
    if not done and record.finish_reason is None:
        raise RuntimeError("stream ended before [DONE]")
    return "".join(parts)


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    record: RequestRecord,
    t0: float,
    tokenizer: Any = None,
    timeout: Optional[float] = None,
) -> RequestRecord:
    """Send one streamed request and fill ``record``; never raises on server errors."""
    chat = "messages" in payload

    async def attempt() -> None:
        async with client.stream("POST", url, json=payload) as resp:
            record.status_code = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {body}")
            text = await _consume_stream(resp, record, t0, chat)
        if not record.usage_reported:
            # Fallback count: exact with a tokenizer, else one token per chunk.
            record.completion_tokens = (
                len(tokenizer.encode(text, add_special_tokens=False).ids) if tokenizer else len(record.chunk_times)
            )

    record.send_time = time.perf_counter() - t0
    try:
        await asyncio.wait_for(attempt(), timeout)
        record.success = True
    except asyncio.TimeoutError:
        record.error = f"timeout after {timeout}s"
    except Exception as exc:  # any failure is a data point, not a crash
        record.error = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
    record.end_time = time.perf_counter() - t0
    if record.error:
        logger.debug("request %d failed: %s", record.index, record.error)
    return record


# --------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------


def validate_config(config: BenchConfig) -> None:
    if config.endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', not {config.endpoint!r}")
    if config.endpoint == "chat" and config.prompts_as_ids:
        raise ValueError("chat messages need text: --prompts-as-ids works with --endpoint completions only")
    if config.num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    if not config.request_rate > 0:
        raise ValueError("request_rate must be > 0 (use inf for all at once)")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    for name in ("random_input_len", "random_output_len"):
        rng_range = getattr(config, name)
        if rng_range is not None and not 0 <= rng_range[0] <= rng_range[1]:
            raise ValueError(f"{name} needs 0 <= LO <= HI")
    if config.shared_prefix_len < 0 or config.num_prefixes < 1:
        raise ValueError("shared_prefix_len must be >= 0 and num_prefixes >= 1")


async def _warm_up(
    config: BenchConfig,
    client: httpx.AsyncClient,
    url: str,
    model: str,
    specs: list[RequestSpec],
    tokenizer: Any,
) -> None:
    # Sequential and discarded: absorbs connection setup, lazy compilation and
    # allocator growth on the server so they do not pollute the first records.
    for i, spec in enumerate(specs):
        rec = RequestRecord(index=-1 - i, prompt_len=spec.prompt_len, max_tokens=spec.output_len)
        payload = make_payload(config, model, spec)
        await send_request(client, url, payload, rec, time.perf_counter(), tokenizer, config.timeout)
        if not rec.success:
            logger.warning("warm-up request %d failed: %s", i, rec.error)


async def _dispatch(
    config: BenchConfig,
    client: httpx.AsyncClient,
    url: str,
    payloads: list[dict[str, Any]],
    specs: list[RequestSpec],
    offsets: np.ndarray,
    tokenizer: Any,
) -> tuple[list[RequestRecord], float]:
    from tqdm import tqdm

    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    pbar = tqdm(total=len(payloads), disable=not config.progress, desc=config.label or "requests", unit="req")

    async def one(i: int, t0: float) -> RequestRecord:
        rec = RequestRecord(index=i, prompt_len=specs[i].prompt_len, max_tokens=specs[i].output_len)
        if sem is None:
            await send_request(client, url, payloads[i], rec, t0, tokenizer, config.timeout)
        else:
            async with sem:  # send_time is taken after the wait: TTFT excludes client queueing
                await send_request(client, url, payloads[i], rec, t0, tokenizer, config.timeout)
        pbar.update(1)
        return rec

    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()
    for i in range(len(payloads)):
        # Absolute schedule, so sleep overshoot does not accumulate as drift.
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, t0)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    pbar.close()
    return records, duration


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run one benchmark described by ``config`` and return its records and summary."""
    validate_config(config)
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    # Independent streams: changing the rate or warm-up count keeps prompts identical.
    prompt_ss, arrival_ss, warm_ss = np.random.SeedSequence(config.seed).spawn(3)
    specs = build_requests(config, tokenizer, np.random.default_rng(prompt_ss), config.num_requests)
    warm_specs = build_requests(config, tokenizer, np.random.default_rng(warm_ss), max(config.warmup, 0))
    offsets = arrival_offsets(config.num_requests, config.request_rate, np.random.default_rng(arrival_ss))
    url = endpoint_url(config)

    async with make_client(config) as client:
        model = config.model or await fetch_first_model(client, config.base_url)
        logger.info(
            "benchmarking %s at %s (%d requests, rate %s)", model, url, config.num_requests, config.request_rate
        )
        payloads = [make_payload(config, model, s) for s in specs]
        await _warm_up(config, client, url, model, warm_specs, tokenizer)
        records, duration = await _dispatch(config, client, url, payloads, specs, offsets, tokenizer)

    failed = [r for r in records if not r.success]
    if failed:
        logger.warning("%d/%d requests failed; first error: %s", len(failed), len(records), failed[0].error)
    summary = summarize(records, duration)
    return BenchResult(config=config, model=model, duration=duration, summary=summary, records=records)


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _json_safe(obj: Any) -> Any:
    """Strict JSON: no NaN/Infinity literals, tuples as lists."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        return obj if math.isfinite(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(result: BenchResult, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_json_safe(result.to_dict()), f, indent=2, allow_nan=False)
    logger.info("wrote %s", path)


def plot_latencies(result: BenchResult, path: str) -> None:
    """Histogram and CDF of TTFT and ITL (ms) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    ok = [r for r in result.records if r.success]
    series = {
        "TTFT": np.array([r.ttft for r in ok if r.ttft is not None]) * 1000.0,
        "ITL": np.array([g for r in ok for g in r.itls]) * 1000.0,
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, (name, values) in enumerate(series.items()):
        hist_ax, cdf_ax = axes[0][col], axes[1][col]
        if values.size:
            hist_ax.hist(values, bins=min(60, max(10, values.size // 5)))
            cdf_ax.plot(np.sort(values), np.arange(1, values.size + 1) / values.size)
        hist_ax.set(title=f"{name} histogram", xlabel="ms", ylabel="count")
        cdf_ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction", ylim=(0, 1.02))
        cdf_ax.grid(alpha=0.3)
    fig.suptitle(f"{result.config.label or result.model}: {result.summary['completed']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Streaming benchmark for OpenAI-compatible servers.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: first id from GET /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("-n", "--num-requests", type=int, default=100)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals; inf (default) sends all at once"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (after any shared prefix)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--random-input-len", type=int, nargs=2, metavar=("LO", "HI"), help="uniform random prompt length")
    p.add_argument("--random-output-len", type=int, nargs=2, metavar=("LO", "HI"), help="uniform random output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer", default=None, help="folder with tokenizer.json, or the file; builds exact-length text prompts"
    )
    p.add_argument("--prompts-as-ids", action="store_true", help="send token-id lists even with a tokenizer")
    p.add_argument("--vocab-low", type=int, default=100, help="lowest random token id")
    p.add_argument(
        "--vocab-high",
        type=int,
        default=None,
        help="exclusive upper token id (default 500, or the vocab size with --tokenizer)",
    )
    p.add_argument(
        "--shared-prefix-len", type=int, default=0, help="tokens in each shared prefix (prefix-cache benchmarks)"
    )
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True, help='send "ignore_eos": true')
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write metrics and per-request records")
    p.add_argument("--plot", dest="plot_out", default=None, metavar="OUT.png", help="TTFT/ITL histogram and CDF")
    p.add_argument("--label", default="", help="name shown in the table")
    p.add_argument("--warmup", type=int, default=1, help="uncounted warm-up requests")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        random_input_len=tuple(args.random_input_len) if args.random_input_len else None,
        random_output_len=tuple(args.random_output_len) if args.random_output_len else None,
        seed=args.seed,
        tokenizer=args.tokenizer,
        prompts_as_ids=args.prompts_as_ids,
        vocab_low=args.vocab_low,
        vocab_high=args.vocab_high,
        shared_prefix_len=args.shared_prefix_len,
        num_prefixes=args.num_prefixes,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        warmup=args.warmup,
        timeout=args.timeout,
        api_key=args.api_key,
        extra_body=args.extra_body,
        label=args.label,
        progress=not args.no_progress,
    )


def _run(coro: Any) -> Any:
    # uvloop lowers client overhead at high request rates; optional.
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = config_from_args(args)
    try:
        validate_config(config)
    except ValueError as exc:
        parser.error(str(exc))
    result = _run(run_benchmark(config))
    print(format_table(result.summary, config.label))
    if args.json_out:
        write_json(result, args.json_out)
    if args.plot_out:
        plot_latencies(result, args.plot_out)
    return 0 if result.summary["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
