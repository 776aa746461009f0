"""Rank 0's side of tensor parallelism: it starts the ranks of node 0, joins
the group, broadcasts each step's plan and, on failure, cuts everyone loose.

Any failure is fatal to the whole group: a follower that died, a broadcast or
forward that raised. Ranks that disagree on which steps ran cannot go on
(their KV pools and placeholders would diverge), so `fail` reports once to
the owner (the server stops with 503 and exits non-zero; the offline API
raises) and closes every lifeline, which makes every follower exit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from aioserve.config import ConfigError, EngineConfig
from aioserve.tp.distributed import destroy_tensor_parallel, init_tensor_parallel
from aioserve.engine.loading import resolve_device
from aioserve.models.eagle3 import Eagle3Config
from aioserve.models.model_config import ModelConfig
from aioserve.models.source import resolve_model_path
from aioserve.speculative_config import resolve_speculative
from aioserve.tp.channel import PlanChannel
from aioserve.tp.lifeline import LeaderLifeline
from aioserve.launch.world import (
    LIFELINE_KEY,
    DistributedInitError,
    check_layout,
    init_timeout,
    node_ranks,
    open_store,
    parse_addr,
    rank_config,
    spawn_followers,
    stop_processes,
)

logger = logging.getLogger(__name__)

# A step must complete within STEP_BOUND_BASE_S plus STEP_BOUND_PER_TOKEN_S for
# each token it runs, or a rank is taken as hung (SIGSTOPped, deadlocked):
# its TCP lifeline stays open, and gloo's own timeout is 10 minutes. The base
# is AIOSERVE_TP_STEP_TIMEOUT seconds when set.
STEP_BOUND_BASE_S = 30.0
STEP_BOUND_PER_TOKEN_S = 0.02
WATCH_INTERVAL_S = 0.25
# How long a failed step waits for a lifeline to name the rank that went away.
LIFELINE_GRACE_S = 1.0


def step_bound(num_tokens: int) -> float:
    base = float(os.environ.get("AIOSERVE_TP_STEP_TIMEOUT", STEP_BOUND_BASE_S))
    return base + STEP_BOUND_PER_TOKEN_S * num_tokens

FailureHandler = Callable[[str], None]


def check_heads_split(config: EngineConfig) -> None:
    """The model's attention heads divide over --tp, and a draft model's or
    an EAGLE-3 head's (sharded like the target): refused here, before any rank starts, not by
    every rank's layers once they load."""
    models = {"the model": ModelConfig.from_path(resolve_model_path(config.model, config.revision))}
    speculative = resolve_speculative(config)
    if speculative is not None and speculative.draft_model is not None:
        path = resolve_model_path(speculative.draft_model, None)
        if speculative.method == "eagle3":
            try:
                models["the EAGLE-3 head"] = Eagle3Config.from_path(path).layer
            except ValueError as exc:  # not a head: the loader says so with its reason
                logger.debug("no head split to check: %s", exc)
        else:
            models["the draft model"] = ModelConfig.from_path(path)
    for what, model_config in models.items():
        heads = model_config.num_heads
        if heads % config.tp_size:
            raise ConfigError(f"--tp {config.tp_size}: {what}'s {heads} attention heads do not divide over "
                              f"{config.tp_size} ranks")
        try:
            model_config.kv_heads_per_rank(config.tp_size)
        except ValueError as exc:
            raise ConfigError(f"--tp {config.tp_size}: {what}'s KV heads: {exc}") from exc


class TPLeader:
    def __init__(self, config: EngineConfig, on_failure: FailureHandler | None = None) -> None:
        check_layout(config)
        check_heads_split(config)
        if config.node_rank != 0:
            raise DistributedInitError("only node 0 runs rank 0 (the HTTP server and the scheduler)")
        self.on_failure: FailureHandler = on_failure or (lambda reason: None)
        self.failure: str | None = None
        self._failed = threading.Event()
        self._fail_lock = threading.Lock()
        self._closed = False
        self._stop_sent = False
        self._threads_before = torch.get_num_threads()
        self.world_size = config.tp_size
        deadline = time.monotonic() + init_timeout()
        if config.dist_init_addr:
            host, port = parse_addr(config.dist_init_addr)
        else:
            host, port = "127.0.0.1", 0  # one node: a free loopback port
        # Every local rank's device and threads, checked before anything starts.
        for spec in node_ranks(config, host, port):
            rank_config(config, spec)
        self.store = open_store(node_ranks(config, host, port)[0], deadline)
        specs = node_ranks(config, host, self.store.port)
        self.rank_config = rank_config(config, specs[0])
        self.device = resolve_device(self.rank_config.device)
        self.lifeline = LeaderLifeline("0.0.0.0" if config.nnodes > 1 else "127.0.0.1")
        self.store.set(LIFELINE_KEY, str(self.lifeline.port))
        self.processes = spawn_followers(specs[1:], config)
        try:
            self.lifeline.accept(set(range(1, self.world_size)), deadline, self._check_children)
        except TimeoutError as exc:
            self.close()
            raise DistributedInitError(
                f"{exc} within {init_timeout():.0f} s at {host}:{self.store.port} "
                f"(are all --nnodes {config.nnodes} nodes started?)"
            ) from None
        except BaseException:
            self.close()
            raise
        try:
            init_tensor_parallel(0, self.world_size, self.store, self.device)
        except BaseException:
            self.close()
            raise
        self.channel = PlanChannel()
        self.lifeline.watch(lambda rank: self.fail(f"rank {rank} exited or became unreachable"))
        # (deadline, bound, what) of the step or heartbeat in flight, None between them.
        self._step_deadline: tuple[float, float, str] | None = None
        threading.Thread(target=self._watch_steps, name="aioserve-tp-step-watch", daemon=True).start()
        logger.info("tensor parallel: %d ranks over %d node(s) met at %s:%d", self.world_size, config.nnodes,
                    host, self.store.port)

    def _check_children(self) -> None:
        for rank, process in self.processes:
            if process.poll() is not None:
                raise DistributedInitError(f"rank {rank} exited with code {process.returncode} while starting")

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def send(self, plan: Any) -> None:
        """Broadcast a step's plan (on the executor's thread, before the forward)."""
        bound = step_bound(plan.num_tokens)
        self._step_deadline = (time.monotonic() + bound, bound, "a step")
        self.channel.send(plan)

    def step_done(self) -> None:
        """The step's forward returned on every rank (its collectives completed)."""
        self._step_deadline = None

    def ping(self) -> None:
        """While idle (engine/idle_heartbeat.py, on the executor's thread, so
        never beside a plan): every follower must answer within a step's
        bound, or the watch below fails the group. A SIGSTOPped follower
        keeps its lifeline open, and with no step running nothing else
        would notice it until a request came."""
        bound = step_bound(0)
        self._step_deadline = (time.monotonic() + bound, bound, "an idle heartbeat")
        self.channel.ping()
        self._step_deadline = None

    def _watch_steps(self) -> None:
        while not self._closed and not self.failed:
            in_flight = self._step_deadline
            if in_flight is not None and time.monotonic() > in_flight[0]:
                self.fail(f"{in_flight[2]} did not complete within {in_flight[1]:.1f} s: a rank is hung")
                return
            time.sleep(WATCH_INTERVAL_S)

    def fail(self, reason: str) -> None:
        """The group is broken: report once, cut every follower loose."""
        with self._fail_lock:
            if self.failure is not None or self._closed:
                return
            self.failure = reason
        logger.error("tensor parallelism failed: %s; stopping every rank", reason)
        self.lifeline.close()
        self.on_failure(reason)
        # Set last: a failed step waiting on it (fail_after_error) then fails its
        # requests after on_failure has been scheduled, so they see the server failed.
        self._failed.set()

    def fail_after_error(self, what: str, exc: BaseException) -> str:
        """A step raised on rank 0: fail the group, and say why. A collective
        that raised usually means a peer went away, and that peer's lifeline
        names it within moments (a dead process's sockets close at once):
        wait that long for it, so clients read the cause ("rank 1 exited"),
        not the symptom (gloo's read error)."""
        self._failed.wait(LIFELINE_GRACE_S)
        self.fail(f"{what} raised on rank 0: {exc!r}")
        return self.failure or f"{what} raised on rank 0: {exc!r}"

    def stop_followers(self) -> None:
        """Tell the followers to exit (on the executor's thread, after the last step)."""
        if self.failed:
            return
        self.lifeline.closing = True  # their exits are expected from here on
        self.channel.send_stop()
        self._stop_sent = True

    def close(self) -> None:
        """Leave the group. After stop_followers: wait for the followers to
        exit. Otherwise (start-up failed, or the group did): cut their
        lifelines so they exit now, and kill node 0's stragglers."""
        if self._closed:
            return
        self._closed = True
        self.lifeline.closing = True
        orderly = self._stop_sent and not self.failed
        if orderly:
            stop_processes(self.processes, timeout=10.0)
            self.lifeline.wait_disconnected(timeout=10.0)  # followers on other nodes
        self.lifeline.close()
        if not orderly:
            stop_processes(self.processes, timeout=5.0)
        # A broken NCCL communicator can hang on destroy; gloo's cannot.
        if orderly or self.device.type != "cuda":
            destroy_tensor_parallel()
        torch.set_num_threads(self._threads_before)
