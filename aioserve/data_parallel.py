"""`aioserve serve --dp N`: N replicas of the server on one machine, each an
`aioserve serve` process of its own (with its own --tp ranks) on a loopback
port, and SGLang's router (`sglang-router`, the `router` extra) in front on
the public --host/--port, routing by prompt prefix (cache_aware) so that a
repeated prefix finds the replica that holds it in its radix cache.

The router is not ours: it is the one SGLang deployments run, launched as
`python -m sglang_router.launch_router` with flags that make failover prompt
(ROUTER_FAILOVER_FLAGS). This process supervises: it restarts a replica that
exits (the router takes it out meanwhile and back once /health answers),
stops everything when the router exits, and on SIGTERM/SIGINT stops the
router and lets the replicas drain. Every child gets SIGTERM from the
kernel if this process dies, however it dies (Linux's parent-death signal),
so no replica or router outlives it.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aioserve.config import ServerArgs
from aioserve.dp_metrics import MergedMetrics

logger = logging.getLogger(__name__)

ROUTER_MODULE = "sglang_router.launch_router"

# The router's defaults notice a dead worker only after 3 health checks 60 s
# apart and open a worker's circuit after 10 failures; these take a replica
# out within about two seconds and put a restarted one back within a second
# of its /health answering. A request that meets a dead replica is retried
# (up to 5 times, backing off from 50 ms) on the workers still healthy.
ROUTER_FAILOVER_FLAGS: tuple[str, ...] = (
    "--health-check-interval-secs", "1",
    "--health-check-timeout-secs", "2",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    "--retry-max-retries", "5",
    "--retry-initial-backoff-ms", "50",
    "--retry-max-backoff-ms", "1000",
    "--cb-failure-threshold", "3",
    "--cb-success-threshold", "1",
    "--cb-timeout-duration-secs", "2",
    "--worker-startup-check-interval", "1",
)

READY_TIMEOUT_S = 1800.0  # a large model's first load; as the router's own worker startup timeout
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 60.0  # a replica up this long has its restart backoff reset
POLL_S = 0.5
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}


class DataParallelError(RuntimeError):
    """The deployment cannot start; the message says why."""


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def metrics_port(args: ServerArgs) -> int:
    """Where the merged /metrics listens: --dp-metrics-port, or after the last replica."""
    return args.dp_metrics_port if args.dp_metrics_port is not None else replica_ports(args)[-1] + 1


def replica_ports(args: ServerArgs) -> list[int]:
    base = args.dp_base_port if args.dp_base_port is not None else args.port + 1
    return [base + i for i in range(args.dp_size)]


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def replica_args(args: ServerArgs, index: int, port: int) -> ServerArgs:
    """Replica `index`'s own server: loopback only (the router is the public
    face), its own port, its own GPUs (tp_size consecutive ones from the
    --device's index) or its share of the cores."""
    engine = args.engine
    from aioserve.engine.loading import resolve_device  # torch: only when --dp is used

    device = resolve_device(engine.device)
    if device.type == "cuda":
        import torch

        first = (device.index or 0) + index * engine.tp_size
        if first + engine.tp_size > torch.cuda.device_count():
            raise DataParallelError(
                f"--dp {args.dp_size} × --tp {engine.tp_size} needs {args.dp_size * engine.tp_size} GPUs from "
                f"cuda:{device.index or 0}; this machine has {torch.cuda.device_count()}"
            )
        engine = dataclasses.replace(engine, device=f"cuda:{first}")
    elif engine.num_threads is None:  # each rank of each replica its share, not every replica all cores
        engine = dataclasses.replace(engine, num_threads=max(1, _cpu_count() // (args.dp_size * engine.tp_size)))
    return dataclasses.replace(
        args, engine=engine, dp_size=1, dp_base_port=None, router_args=None, host="127.0.0.1", port=port
    )


def router_command(args: ServerArgs, worker_urls: list[str]) -> list[str]:
    """sglang-router's command line; --router-args come last, so they
    override any flag set here."""
    command = [
        sys.executable, "-m", ROUTER_MODULE,
        "--host", args.host, "--port", str(args.port),
        "--prometheus-host", args.host,  # its metrics where the router listens, not on every interface
        "--worker-urls", *worker_urls,
        "--policy", args.router_policy,
        "--log-level", ROUTER_LOG_LEVELS[args.log_level],
        "--shutdown-grace-period-secs", str(max(1, round(args.shutdown_timeout))),
        *ROUTER_FAILOVER_FLAGS,
    ]
    api_key = args.api_key or os.environ.get("AIOSERVE_API_KEY")
    if api_key:  # the key the router sends to the replicas
        command += ["--api-key", api_key]
    return command + shlex.split(args.router_args or "")


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A child's pre-exec step: SIGTERM when the parent dies (Linux
    PR_SET_PDEATHSIG), and exit at once if it died already."""

    def arm() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _child_env() -> dict[str, str]:
    """Children import this package also when it runs from a checkout."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Child:
    """A replica or the router: its command and its current process."""

    name: str
    command: list[str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0  # since it last ran STABLE_AFTER_S
    restart_at: float | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, env=_child_env(), preexec_fn=_die_with_parent(os.getpid()))
        self.started_at = time.monotonic()
        self.restart_at = None
        logger.info("%s started (pid %d)", self.name, self.process.pid)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)


@dataclass
class Deployment:
    args: ServerArgs
    replicas: list[Child]
    router: Child
    urls: list[str]
    stopping: bool = False
    signals: int = 0

    def on_signal(self, signum: int, _frame: object) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("second %s: killing the router and the replicas", signal.Signals(signum).name)
            for child in self.children:
                child.signal(signal.SIGKILL)
            os._exit(128 + signum)
        logger.info("%s: stopping the router; the replicas drain", signal.Signals(signum).name)
        self.stopping = True
        for child in self.children:
            child.signal(signal.SIGTERM)

    @property
    def children(self) -> list[Child]:
        return [self.router, *self.replicas]

    def wait_ready(self) -> None:
        """Until every replica's /health answers 200 (a replica that exits
        meanwhile fails the start)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = dict(zip(self.urls, self.replicas))
        while waiting and not self.stopping:
            for url, replica in list(waiting.items()):
                code = replica.exited()
                if code is not None:
                    raise DataParallelError(f"{replica.name} exited with status {code} while starting")
                if _healthy(url):
                    logger.info("%s ready at %s", replica.name, url)
                    del waiting[url]
            if time.monotonic() > deadline:
                raise DataParallelError(f"replicas not ready after {READY_TIMEOUT_S:.0f} s: {sorted(waiting)}")
            time.sleep(POLL_S)

    def supervise(self) -> int:
        """Restart replicas that exit; return when the router exits."""
        while True:
            code = self.router.exited()
            if code is not None:
                if not self.stopping:
                    logger.error("the router exited with status %d; stopping the replicas", code)
                return 0 if self.stopping else (code or 1)
            if not self.stopping:
                for replica in self.replicas:
                    self._keep_running(replica)
            time.sleep(POLL_S)

    def _keep_running(self, replica: Child) -> None:
        now = time.monotonic()
        if replica.restart_at is not None:
            if now >= replica.restart_at:
                replica.start()
            return
        code = replica.exited()
        if code is None:
            if now - replica.started_at > STABLE_AFTER_S:
                replica.restarts = 0
            return
        delay = RESTART_BACKOFF_S[min(replica.restarts, len(RESTART_BACKOFF_S) - 1)]
        replica.restarts += 1
        replica.restart_at = now + delay
        logger.warning("%s exited with status %d; restarting it in %.0f s", replica.name, code, delay)

    def stop(self, timeout: float) -> None:
        """SIGTERM to all still running; SIGKILL to what outlives `timeout`."""
        for child in self.children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) did not exit; killing it", child.name, child.process.pid)
                child.process.kill()
                child.process.wait()


def check(args: ServerArgs) -> None:
    if args.engine.nnodes > 1:
        raise DataParallelError(
            "--dp runs its replicas on this machine; across machines run one `aioserve serve` per node and "
            "sglang-router in front (docs/deployment.md)"
        )
    if not router_available():
        raise DataParallelError(
            "--dp needs the router: pip install 'aioserve[router]' (sglang-router from PyPI)"
        )
    taken = set(replica_ports(args)) & {args.port}
    if taken:
        raise DataParallelError(f"--dp-base-port puts a replica on the router's port {args.port}")
    # A replica port another program listens on would pass the readiness
    # check on that program's /health and have the router send to it.
    wanted = [("127.0.0.1", port, "replica") for port in replica_ports(args)]
    wanted += [(args.host, metrics_port(args), "merged /metrics"), (args.host, args.port, "router")]
    busy = [f"{port} ({what})" for host, port, what in wanted if not _port_free(host, port)]
    if busy:
        raise DataParallelError(
            f"port in use on this machine: {', '.join(busy)}; choose others with --port, --dp-base-port "
            "or --dp-metrics-port"
        )


def _port_free(host: str, port: int) -> bool:
    """Whether no program listens on host:port now (bound as a server binds:
    a port left in TIME_WAIT counts as free). Only "address in use" counts:
    an address this machine cannot bind is the server's own error to give."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def run_data_parallel(args: ServerArgs, argv_of: Callable[[ServerArgs], list[str]]) -> int:
    """Run the deployment until a signal or the router's exit; the exit
    status. `argv_of` turns a replica's ServerArgs into `aioserve serve`'s
    flags (cli.serve_argv)."""
    check(args)
    ports = replica_ports(args)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    replicas = [
        Child(f"replica {i}", [sys.executable, "-m", "aioserve", "serve", *argv_of(replica_args(args, i, port))])
        for i, port in enumerate(ports)
    ]
    deployment = Deployment(args, replicas, Child("router", router_command(args, urls)), urls)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, deployment.on_signal)
    try:
        for replica in replicas:
            replica.start()
        deployment.wait_ready()
        if deployment.stopping:
            return 0
        deployment.router.start()
        logger.info(
            "serving %d replicas behind sglang-router (%s) at http://%s:%d",
            args.dp_size, args.router_policy, args.host, args.port,
        )
        # The router passes the OpenAI and SGLang routes only: the replicas'
        # metrics are merged here; the page and /docs are each replica's.
        metrics = MergedMetrics(urls, args.host, metrics_port(args))
        metrics.start()
        logger.info("the replicas' /metrics merged at %s (the router passes no /, /docs or /metrics; each replica "
                    "serves them on its own port: %s)", metrics.url, ", ".join(urls))
        return deployment.supervise()
    except DataParallelError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        deployment.stop(args.shutdown_timeout + 10.0)
