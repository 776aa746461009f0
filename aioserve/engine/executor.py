"""Where forwards run, so that the event loop never waits on one.

`submit(plan)` returns an asyncio future of the step's CPU output. Steps run
strictly in submission order, which is what lets a plan refer to tokens of
the step before it (placeholders) and lets freed KV pages be reused by the
next plan at once.

* CPU: one dedicated forward thread. torch ops release the GIL, so the loop
  keeps serving HTTP and preparing the next plan meanwhile. The engine is
  built on that thread too (`start_executor`), so that it is the only thread
  with an OpenMP team (see aioserve/cpu/openmp.py: the loading thread's team,
  left alive beside the forward thread's, made a tiny-llama decode step at
  16 requests 11 ms instead of 7 on 2 cores).
* CUDA: a launcher thread enqueues each step on the engine's own stream and
  records an event after the device-to-host copies; a waiter thread blocks
  on that event. Launching step N+1 does not wait for step N to finish.

Under tensor parallelism (a `PlanBroadcaster`, rank 0's TPLeader) the same
thread that launches a step first broadcasts its plan to the followers, so
the event loop never blocks on a collective and plans reach the followers in
execution order. Any exception on that path is fatal to the group; at
shutdown the followers are told to stop after the last step. While no step
runs, the same thread pings the followers (engine/idle_heartbeat.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from aioserve.batch_plan import BatchPlan, StepOutput
from aioserve.config import EngineConfig
from aioserve.engine.engine import Engine
from aioserve.engine.idle_heartbeat import IdleHeartbeat
from aioserve.engine.loading import resolve_device

T = TypeVar("T")


class PlanBroadcaster(Protocol):
    """Rank 0's link to the follower ranks (launch/leader.py)."""

    @property
    def failed(self) -> bool: ...

    def send(self, plan: BatchPlan) -> None: ...

    def step_done(self) -> None: ...

    def fail(self, reason: str) -> None: ...

    def fail_after_error(self, what: str, exc: BaseException) -> str: ...

    def ping(self) -> None: ...

    def stop_followers(self) -> None: ...

    def close(self) -> None: ...


class TensorParallelFailure(RuntimeError):
    """A step failed under tensor parallelism; the group is broken."""


def _fatal_on_error(leader: PlanBroadcaster | None, what: str, fn: Callable[..., T], *args: object) -> T:
    """Run fn; under tensor parallelism an exception also fails the group
    (the ranks no longer agree on which steps ran)."""
    try:
        return fn(*args)
    except Exception as exc:
        if leader is None:
            raise
        # The step's requests fail with the group's reason (which rank went away), not the collective's error.
        raise TensorParallelFailure(leader.fail_after_error(what, exc)) from exc


def _shutdown(
    leader: PlanBroadcaster | None, threads: list[concurrent.futures.ThreadPoolExecutor],
    heartbeat: IdleHeartbeat | None,
) -> None:
    """Stop the followers after the last step (on the step thread), then the
    threads. After a failure nothing waits: a thread may be stuck in a
    collective with a dead rank."""
    if heartbeat is not None:
        heartbeat.stop()  # a ping already queued goes first; none after the followers' stop
    if leader is not None and not leader.failed:
        try:
            threads[0].submit(leader.stop_followers).result(timeout=30)
        except Exception as exc:
            leader.fail(f"stopping the followers failed: {exc!r}")
    healthy = leader is None or not leader.failed
    for thread in threads:
        thread.shutdown(wait=healthy, cancel_futures=not healthy)
    if leader is not None:
        leader.close()


class StepExecutor(Protocol):
    def submit(self, plan: BatchPlan) -> "asyncio.Future[StepOutput]": ...

    def shutdown(self) -> None: ...


def _step_thread(name: str) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)


class ThreadExecutor:
    def __init__(
        self,
        engine: Engine,
        leader: PlanBroadcaster | None = None,
        thread: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.leader = leader
        self._thread = thread or _step_thread("aioserve-forward")
        self._heartbeat = IdleHeartbeat(leader, self._thread) if leader is not None else None

    def _step(self, plan: BatchPlan) -> StepOutput:
        if self.leader is not None:
            self.leader.send(plan)
        output = self.engine.forward(plan)
        if self.leader is not None:
            self.leader.step_done()
        return output

    def submit(self, plan: BatchPlan) -> "asyncio.Future[StepOutput]":
        what = f"step {plan.step}"
        done = self._thread.submit(_fatal_on_error, self.leader, what, self._step, plan)
        if self._heartbeat is not None:
            self._heartbeat.step_submitted(done)
        return asyncio.wrap_future(done)

    def shutdown(self) -> None:
        _shutdown(self.leader, [self._thread], self._heartbeat)


class CudaStreamExecutor:
    def __init__(
        self,
        engine: Engine,
        leader: PlanBroadcaster | None = None,
        launcher: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.leader = leader
        self.stream = torch.cuda.Stream(engine.device)
        self._launcher = launcher or _step_thread("aioserve-launch")
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioserve-cuda-wait")
        # Pings go to the launcher: the thread that broadcasts plans.
        self._heartbeat = IdleHeartbeat(leader, self._launcher) if leader is not None else None

    def _launch(self, plan: BatchPlan) -> tuple[StepOutput, torch.cuda.Event]:
        if self.leader is not None:
            self.leader.send(plan)
        with torch.cuda.stream(self.stream):
            output = self.engine.launch(plan).to(torch.device("cpu"))
            done = torch.cuda.Event()
            done.record(self.stream)
        return output, done

    def _wait(self, launched: concurrent.futures.Future) -> StepOutput:
        output, done = launched.result()
        done.synchronize()
        if self.leader is not None:
            self.leader.step_done()
        return output

    def submit(self, plan: BatchPlan) -> "asyncio.Future[StepOutput]":
        what = f"step {plan.step}"
        launched = self._launcher.submit(_fatal_on_error, self.leader, what, self._launch, plan)
        done = self._waiter.submit(_fatal_on_error, self.leader, what, self._wait, launched)
        if self._heartbeat is not None:
            self._heartbeat.step_submitted(done)  # in flight until its outputs are on the host
        return asyncio.wrap_future(done)

    def shutdown(self) -> None:
        _shutdown(self.leader, [self._launcher, self._waiter], self._heartbeat)


def start_executor(config: EngineConfig, leader: PlanBroadcaster | None = None) -> tuple[Engine, StepExecutor]:
    """Build the engine on the thread that will launch its steps, and the
    executor for its device around it; `leader` under tensor parallelism."""
    cuda = resolve_device(config.device).type == "cuda"
    thread = _step_thread("aioserve-launch" if cuda else "aioserve-forward")
    try:
        engine = thread.submit(Engine, config).result()
    except BaseException:
        thread.shutdown(wait=False)
        raise
    if cuda:
        return engine, CudaStreamExecutor(engine, leader, launcher=thread)
    return engine, ThreadExecutor(engine, leader, thread=thread)
