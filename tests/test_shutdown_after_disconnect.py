"""SIGTERM after a client left: the drain waits only for the real in-flight
work. Generation.close() marks a departed client's streams finished, so the
server exits as soon as the live request ends (before, it could wait the whole
--shutdown-timeout for a request the scheduler had already aborted, depending
on when a weak set's entry was collected)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_harness import start_server

EXIT_WITHIN_S = 2.0


def _live_stream(url: str, finished_at: list[float], events: list[str]) -> threading.Thread:
    def run() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                events.append(line)
        finished_at.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _leave_mid_stream(url: str) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                break  # leaving the block closes the connection


def run_once(stories_path: Path) -> float:
    """Seconds from the live request's end to the server's exit."""
    server = start_server(stories_path, "--page-size", "4", "--shutdown-timeout", "30")
    try:
        _leave_mid_stream(server.url)
        finished_at: list[float] = []
        events: list[str] = []
        live = _live_stream(server.url, finished_at, events)
        time.sleep(0.2)
        server.process.send_signal(signal.SIGTERM)
        live.join(60)
        assert "data: [DONE]" in events, events[-3:]
        assert server.process.wait(40) == 0
        return time.monotonic() - finished_at[0]
    finally:
        if server.process.poll() is None:
            server.stop()


@pytest.mark.parametrize("run", range(3))
def test_sigterm_after_a_disconnect_exits_when_the_live_work_ends(stories_path: Path, run: int) -> None:
    assert run_once(stories_path) < EXIT_WITHIN_S


@pytest.mark.slow
def test_sigterm_after_a_disconnect_twenty_runs(stories_path: Path) -> None:
    waits = [run_once(stories_path) for _ in range(20)]
    assert max(waits) < EXIT_WITHIN_S, waits
