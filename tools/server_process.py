"""Run `aioserve serve` as a child process on a free loopback port: for
tests, benchmarks and scripts that need a real server to talk to."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int, attempts: int = 100) -> int:
    """The first of `count` consecutive loopback ports free at once (a
    deployment that listens on base, base + 1, ...): each is bound together
    before any is given back, so none is another listener's."""
    for _ in range(attempts):
        base = free_port()
        if base + count > 65536:
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free loopback ports in {attempts} attempts")


def wait_for_health(url: str, gone: Callable[[], str | None], timeout: float, interval: float = 0.2) -> str | None:
    """Poll `url`/health until it answers 200: None then. Else why not: what
    `gone()` says once the server has stopped running (it returns None while
    the server runs), or that `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        why = gone()
        if why is not None:
            return why
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return f"no /health after {timeout} s"


def process_gone(process: subprocess.Popen, log: Callable[[], str]) -> Callable[[], str | None]:
    """`wait_for_health`'s `gone` for a child process: its exit code and log tail."""
    def gone() -> str | None:
        code = process.poll()
        return None if code is None else f"server exited with {code}:\n{log()[-4000:]}"
    return gone


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path
    api_key: str | None = None  # sent on our own calls (/server_info) when the server wants one

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def info(self) -> dict:
        """GET /server_info: KV pool occupancy and scheduler counters."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(f"{self.url}/server_info", headers=headers, timeout=30).json()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()

    @classmethod
    def start(cls, model: str | Path, *args: str, timeout: float = 600.0, log_path: str | None = None) -> "ServerProcess":
        """Start the server and return once /health answers 200."""
        port = free_port()
        log = Path(log_path or tempfile.mkstemp(prefix="aioserve-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "aioserve", "serve", "--model", str(model), "--port", str(port), *args]
        process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
        key = args[args.index("--api-key") + 1] if "--api-key" in args else os.environ.get("AIOSERVE_API_KEY")
        server = cls(f"http://127.0.0.1:{port}", process, log, key)
        why = wait_for_health(server.url, process_gone(process, server.log), timeout)
        if why is None:
            return server
        if process.poll() is not None:
            raise RuntimeError(why)
        server.stop()
        raise TimeoutError(f"server not ready: {why}:\n{server.log()[-4000:]}")
