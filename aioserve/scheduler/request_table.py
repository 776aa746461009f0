"""Where every request is (waiting, running, or gone), the moves between
those places, and the delivery of events to each request's consumer.

Each move is paired with the KVManager call it needs, so the queues and the
KV pool cannot disagree: `start` takes a KV handle from admission, `preempt`
and `finish` release it. A consumer whose sink raises fails its own request
only; the scheduler loop never sees the exception.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from aioserve.kvcache.manager import KVManager
from aioserve.kvcache.request_kv import RequestKV
from aioserve.scheduler.adapters import AdapterTable
from aioserve.scheduler.encoder_cache import EncoderCacheTable
from aioserve.scheduler.request import Request, RequestEvent, Status

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    steps: int = 0
    steps_done: int = 0  # steps whose output was processed: what a readiness probe watches advance
    token_waits: int = 0  # steps planned only after the step in flight landed (overlap given up for it)
    prompt_tokens: int = 0  # prompt tokens of finished-or-running requests, once each
    prefill_tokens: int = 0  # tokens computed by prefill chunks
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    generated_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    last_prefill_tokens: int = 0  # prefill tokens of the latest step that had any
    peak_running: int = 0  # most requests admitted at once


class RequestTable:
    def __init__(self, kv: KVManager, adapters: AdapterTable | None = None) -> None:
        self.kv = kv
        self.adapters = adapters  # with LoRA served: the slots requests hold while running
        self.images = EncoderCacheTable()  # the images' embeddings the engine holds for running requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.by_id: dict[str, Request] = {}
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        self.by_id[request.rid] = request
        self.waiting.append(request)
        if request.adapter is not None and self.adapters is not None:
            self.adapters.request_added(request.adapter)

    def start(self, request: Request, kv: RequestKV) -> None:
        """The head of the queue was admitted with `kv`."""
        if self.waiting[0] is not request:
            raise RuntimeError("admission is in arrival order")
        self.waiting.popleft()
        request.kv = kv
        request.status = Status.RUNNING
        if request.num_cached_tokens is None:  # first admission: count its prompt once
            request.admitted_at = time.monotonic()
            request.num_cached_tokens = kv.kv_done
            self.stats.cached_tokens += kv.kv_done
            self.stats.prompt_tokens += request.num_prompt_tokens
        self.running.append(request)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))

    def preempt(self, request: Request) -> None:
        """Free a running request's KV and queue it first, to recompute later
        (its computed pages go to the prefix cache, so often little is lost)."""
        self._release(request)
        request.status = Status.WAITING
        self.stats.preemptions += 1
        self.waiting.appendleft(request)
        logger.info(
            "preempted request %s (%d tokens) to free KV pages; %d preemptions so far",
            request.rid, request.seq_len, self.stats.preemptions,
        )

    def finish(self, request: Request, reason: str, event: RequestEvent | None = None) -> None:
        """End `request` (stop | length | abort | error), free what it holds and
        send `event` (by default a bare one with the reason)."""
        if request.status is Status.RUNNING:
            self._release(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        self.by_id.pop(request.rid, None)
        self._adapter_done(request)
        if reason in ("stop", "length"):
            self.stats.finished += 1
        elif reason == "abort":
            self.stats.aborted += 1
        self.deliver(request, event or RequestEvent(finish_reason=reason))

    def drop(self, request: Request, event: RequestEvent) -> None:
        """End `request` with an error without releasing its KV: for when
        releasing it failed (the bookkeeping is broken and will be reset).
        Its consumer still hears the end."""
        for queue in (self.running, self.waiting):
            if request in queue:
                queue.remove(request)
        self.by_id.pop(request.rid, None)
        if request.lora_slot and self.adapters is not None:
            self.adapters.release(request.lora_slot)
            request.lora_slot = 0
        self.images.release(request.rid)
        request.status, request.finish_reason, request.kv = Status.FINISHED, "error", None
        self._adapter_done(request)
        self.deliver(request, event)

    def deliver(self, request: Request, event: RequestEvent) -> None:
        """Send `event` to the request's consumer; a consumer that raises
        ends its own request with an error."""
        try:
            request.sink(event)
        except Exception:
            logger.exception("the consumer of request %s failed; ending it", request.rid)
            if not request.finished:
                self.finish(request, "error", RequestEvent(finish_reason="error", error="the consumer failed"))

    def _release(self, request: Request) -> None:
        assert request.kv is not None
        self.kv.release(request.kv, request.cache_ids)
        self.images.release(request.rid)
        self.running.remove(request)
        request.kv = None
        if request.lora_slot and self.adapters is not None:
            self.adapters.release(request.lora_slot)
            request.lora_slot = 0

    def _adapter_done(self, request: Request) -> None:
        if request.adapter is not None and self.adapters is not None:
            self.adapters.request_done(request.adapter)
