"""Where forwards run, so that the event loop never waits on one.

`submit(plan)` returns an asyncio future of the step's CPU output. Steps run
strictly in submission order, which is what lets a plan refer to tokens of
the step before it (placeholders) and lets freed KV pages be reused by the
next plan at once.

* CPU: one dedicated forward thread. torch ops release the GIL, so the loop
  keeps serving HTTP and preparing the next plan meanwhile.
* CUDA: a launcher thread enqueues each step on the engine's own stream and
  records an event after the device-to-host copies; a waiter thread blocks
  on that event. Launching step N+1 does not wait for step N to finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Protocol

import torch

from aioserve.batch_plan import BatchPlan, StepOutput
from aioserve.engine.engine import Engine


class StepExecutor(Protocol):
    def submit(self, plan: BatchPlan) -> "asyncio.Future[StepOutput]": ...

    def shutdown(self) -> None: ...


class ThreadExecutor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioserve-forward")

    def submit(self, plan: BatchPlan) -> "asyncio.Future[StepOutput]":
        return asyncio.wrap_future(self._thread.submit(self.engine.forward, plan))

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


class CudaStreamExecutor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stream = torch.cuda.Stream(engine.device)
        self._launcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioserve-launch")
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioserve-cuda-wait")

    def _launch(self, plan: BatchPlan) -> tuple[StepOutput, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            output = self.engine.launch(plan).to(torch.device("cpu"))
            done = torch.cuda.Event()
            done.record(self.stream)
        return output, done

    def _wait(self, launched: concurrent.futures.Future) -> StepOutput:
        output, done = launched.result()
        done.synchronize()
        return output

    def submit(self, plan: BatchPlan) -> "asyncio.Future[StepOutput]":
        launched = self._launcher.submit(self._launch, plan)
        return asyncio.wrap_future(self._waiter.submit(self._wait, launched))

    def shutdown(self) -> None:
        self._launcher.shutdown(wait=True)
        self._waiter.shutdown(wait=True)


def create_executor(engine: Engine) -> StepExecutor:
    return CudaStreamExecutor(engine) if engine.device.type == "cuda" else ThreadExecutor(engine)
