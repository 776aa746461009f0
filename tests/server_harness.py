"""The real server in a subprocess, plus what tests ask of it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from server_process import ServerProcess


class RunningServer(ServerProcess):
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
