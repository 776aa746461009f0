"""Start the real server in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def info(self) -> dict:
        return httpx.get(f"{self.url}/server_info", timeout=10).json()

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

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_server(model: Path | str, *args: str, timeout: float = 120.0) -> RunningServer:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="aioserve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "aioserve", "serve", "--model", str(model), "--port", str(port), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise TimeoutError(f"server not ready after {timeout}s:\n{server.log()}")
