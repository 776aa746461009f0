"""Hostile load, round two: one member of each class of abusive body, sent
to a running server while /health is polled every 10 ms and a plain
completion runs beside it.

Prints, per body: its status and time, the slowest /health answer while it
ran (the event loop's worst stall), the plain completion's latency, and the
server's RSS before and after. The classes (issue 44): products of bounds
(logprob entries), text that reaches the chat template, grammar compiles,
wide or deep JSON, malformed values.

    python benchmarks/hostile_probe.py [--model DIR] [--server-arg=--max-json-depth=128]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerProcess  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
BIG_TEXT = "word " * (2 << 20)  # 10 MB


def _deep(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": ' + \
        b"[" * depth + b"]" * depth + b"}}"


# (class, name, path, body)
BODIES: list[tuple[str, str, str, dict[str, Any] | bytes]] = [
    ("1 product", "8 prompts x n=128, echo, 20 logprobs", "/v1/completions",
     {"prompt": ["word " * 100] * 8, "n": 128, "echo": True, "logprobs": 20, "max_tokens": 1}),
    ("2 template text", "10 MB assistant message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": BIG_TEXT},
                   {"role": "user", "content": "and?"}], "max_tokens": 1}),
    ("3 grammar", "50k guided choices", "/v1/completions",
     {"prompt": "x", "max_tokens": 1, "guided_choice": [f"option number {i}" for i in range(50_000)]}),
    ("3 grammar", "1.2 MB EBNF", "/v1/completions",
     {"prompt": "x", "max_tokens": 1,
      "structured_outputs": {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(150_000))}}),
    ("4 wide JSON", "450k Responses input items", "/v1/responses",
     {"input": [{"role": "user", "content": "hi"}] * 450_000}),
    ("4 wide JSON", "1.5M schema examples", "/v1/chat/completions",
     {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "integer", "examples": list(range(1_500_000))}}}}),
    ("5 malformed", "chat_template_kwargs 900 deep", "/v1/chat/completions", _deep(900)),
    ("5 malformed", "a 5000-digit integer", "/v1/completions",
     b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
]


@dataclass
class Row:
    kind: str
    name: str
    status: int | str
    seconds: float
    worst_health_s: float
    plain_s: float
    rss_before_mib: float
    rss_after_mib: float


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def probe(server: ServerProcess, kind: str, name: str, path: str, body: dict[str, Any] | bytes) -> Row:
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get(f"{server.url}/health")
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    plain: list[float] = []

    def plain_completion() -> None:
        start = time.perf_counter()
        httpx.post(f"{server.v1}/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        plain.append(time.perf_counter() - start)

    before = rss_mib(server.process.pid)
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.1)
    side = threading.Thread(target=plain_completion)
    start = time.perf_counter()
    side.start()
    try:
        response = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"},
                              timeout=300)
        status: int | str = response.status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    seconds = time.perf_counter() - start
    side.join()
    time.sleep(0.1)
    stop.set()
    poller.join()
    return Row(kind, name, status, seconds, max(latencies), plain[0], before, rss_mib(server.process.pid))


def print_table(rows: list[Row]) -> None:
    print(f"{'class':<16} {'body':<38} {'status':>6} {'s':>6} {'worst /health ms':>16} {'plain s':>7} "
          f"{'RSS MiB before -> after':>24}")
    for r in rows:
        print(f"{r.kind:<16} {r.name:<38} {r.status!s:>6} {r.seconds:>6.2f} {r.worst_health_s * 1000:>16.0f} "
              f"{r.plain_s:>7.2f} {r.rss_before_mib:>11.0f} -> {r.rss_after_mib:<10.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    args = parser.parse_args()
    server = ServerProcess.start(args.model, "--page-size", "4", *args.server_arg, timeout=300)
    try:
        rows = [probe(server, *body) for body in tqdm(BODIES, desc="bodies")]
    finally:
        server.stop()
    print_table(rows)


if __name__ == "__main__":
    main()
