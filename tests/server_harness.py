"""The real server in a subprocess, plus what tests ask of it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from server_process import ServerProcess


class RunningServer(ServerProcess):
    def streamed_completion_text(self, body: dict) -> str:
        """A streamed /v1/completions' text, its chunks joined (200 asserted)."""
        pieces: list[str] = []
        with httpx.stream("POST", f"{self.v1}/completions", json={**body, "stream": True}, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(pieces)

    def wait_idle(self, timeout: float = 5.0) -> dict:
        """server_info once nothing runs or waits (raises after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if info["running"] == 0 and info["waiting"] == 0:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy: {info}")
            time.sleep(0.02)


def start_server(model: Path | str, *args: str, timeout: float = 120.0) -> RunningServer:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return RunningServer.start(model, *args, timeout=timeout)
