"""Where the tensor-parallel ranks run and how they meet.

`--tp N` over `--nnodes M` gives each node N / M consecutive ranks; rank 0
(node 0's first) serves HTTP. On every node the first rank is the process
the user started and the others are its child processes
(`python -m aioserve.launch.follower`), one per GPU on CUDA, one per
share of the cores on CPU. The ranks meet at rank 0's rendezvous
(`--dist-init-addr HOST:PORT`, or a free loopback port on one node): a
torch TCPStore, through which rank 0 also publishes its lifeline port.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from aioserve.config import EngineConfig
from aioserve.engine.loading import resolve_device

logger = logging.getLogger(__name__)

INIT_TIMEOUT_ENV = "AIOSERVE_DIST_INIT_TIMEOUT"
LIFELINE_KEY = "aioserve/lifeline_port"


class DistributedInitError(RuntimeError):
    """The ranks could not start or meet; the message says why."""


def init_timeout() -> float:
    """Seconds a rank waits for the others at start-up (model loading is not included)."""
    return float(os.environ.get(INIT_TIMEOUT_ENV, "120"))


def is_distributed(config: EngineConfig) -> bool:
    return config.tp_size > 1 or config.nnodes > 1


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    local_rank: int  # index on its node: which GPU
    ranks_per_node: int
    host: str  # rank 0's rendezvous
    port: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def parse_addr(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistributedInitError(f"--dist-init-addr must be HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


def check_layout(config: EngineConfig) -> None:
    if config.tp_size < 1 or config.nnodes < 1:
        raise DistributedInitError("--tp and --nnodes must be at least 1")
    if config.tp_size % config.nnodes:
        raise DistributedInitError(f"--tp {config.tp_size} does not divide evenly over --nnodes {config.nnodes}")
    if not 0 <= config.node_rank < config.nnodes:
        raise DistributedInitError(f"--node-rank {config.node_rank} is not in [0, {config.nnodes})")
    if config.nnodes > 1 and not config.dist_init_addr:
        raise DistributedInitError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")


def node_ranks(config: EngineConfig, host: str, port: int) -> list[RankSpec]:
    """The ranks this node runs, its own process first."""
    per_node = config.tp_size // config.nnodes
    first = config.node_rank * per_node
    return [RankSpec(first + i, config.tp_size, i, per_node, host, port) for i in range(per_node)]


def rank_config(config: EngineConfig, spec: RankSpec) -> EngineConfig:
    """The engine config of one rank: its own GPU, or its share of the cores."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        base = device.index or 0
        index = base + spec.local_rank
        if index >= torch.cuda.device_count():
            raise DistributedInitError(
                f"rank {spec.rank} needs cuda:{index}, but this node has {torch.cuda.device_count()} GPU(s)"
            )
        return dataclasses.replace(config, device=f"cuda:{index}")
    threads = config.num_threads
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // spec.ranks_per_node)
    return dataclasses.replace(config, device=str(device), num_threads=threads)


def spawn_followers(specs: list[RankSpec], config: EngineConfig) -> list[tuple[int, subprocess.Popen]]:
    """Start one child process per rank in `specs` (logs go to ours)."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    configs = [rank_config(config, spec) for spec in specs]  # refuse a bad layout before starting any
    # The children import this very package, also when it runs from a checkout.
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    processes = []
    for spec, rank_cfg in zip(specs, configs):
        message = {"spec": dataclasses.asdict(spec), "config": dataclasses.asdict(rank_cfg), "log_level": level}
        cmd = [sys.executable, "-m", "aioserve.launch.follower", json.dumps(message)]
        processes.append((spec.rank, subprocess.Popen(cmd, env=env)))
    return processes


def stop_processes(processes: list[tuple[int, subprocess.Popen]], timeout: float) -> None:
    """Wait for child ranks to exit; kill those still running after `timeout`."""
    deadline = time.monotonic() + timeout
    for rank, process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("rank %d (pid %d) did not exit; killing it", rank, process.pid)
            process.kill()
            process.wait()


def wait_reachable(host: str, port: int, deadline: float) -> None:
    """Block until something listens at host:port (rank 0's rendezvous), or
    raise DistributedInitError at `deadline`."""
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise DistributedInitError(
                    f"cannot reach rank 0's rendezvous at {host}:{port} after {init_timeout():.0f} s ({exc}); "
                    f"is node 0 running with --dist-init-addr {host}:{port}? "
                    f"(set {INIT_TIMEOUT_ENV} to wait longer)"
                ) from None
            time.sleep(0.25)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket bound to `host` only. TCPStore, given a host, still
    listens on every interface (with no authentication); handed this socket
    it listens where the log says: loopback for one node, --dist-init-addr's
    host for several (the one port the other nodes must reach)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def open_store(spec: RankSpec, deadline: float) -> dist.TCPStore:
    """Rank 0 hosts the TCPStore (at port 0: a free one, see `.port`); the
    other ranks connect to it."""
    timeout = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    if spec.is_leader:
        try:
            listener = listen_socket(spec.host, spec.port)
        except OSError as exc:
            raise DistributedInitError(f"rank 0 cannot listen at {spec.host}:{spec.port}: {exc}") from None
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns it from here
        try:
            return dist.TCPStore(spec.host, port, spec.world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False, master_listen_fd=fd)
        except Exception as exc:
            os.close(fd)
            raise DistributedInitError(f"rank 0 cannot listen at {spec.host}:{spec.port}: {exc}") from None
    wait_reachable(spec.host, spec.port, deadline)
    return dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
