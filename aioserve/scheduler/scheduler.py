"""The scheduler: which requests run each step, and what happens with the
tokens that come back.

Each step holds every decoding request (one token each) plus prefill
chunks of up to `max_prefill_tokens` tokens: first the prompts already under
way, then new requests admitted in arrival order while KV pages allow. So a
long prompt is cut into chunks and the running streams keep decoding
between them.

`run()` is the async loop. With overlap it plans and launches step N+1
before it waits for step N, then processes N's tokens while N+1 runs; plans
refer to not-yet-known tokens by placeholder (see batch_plan). Everything
here runs on the event loop's thread: submit and abort are plain calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

from aioserve.batch_plan import StepOutput
from aioserve.config import EngineConfig
from aioserve.engine.executor import StepExecutor
from aioserve.kvcache.manager import KVManager
from aioserve.kvcache.prefix_cache import PrefixMatch
from aioserve.scheduler.plan_builder import PlanBuilder, ScheduledStep, StepEntry
from aioserve.scheduler.request import Request, RequestEvent, RequestRejected, Status
from aioserve.scheduler.sampling_batch import SampleRow, SamplingBatchBuilder

logger = logging.getLogger(__name__)


@dataclass
class ModelFacts:
    """What the scheduler must know of the engine."""

    num_pages: int
    page_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]


@dataclass
class SchedulerStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of finished-or-running requests, once each
    prefill_tokens: int = 0  # tokens computed by prefill chunks
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    generated_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    last_prefill_tokens: int = 0  # prefill tokens of the latest step that had any
    peak_running: int = 0  # most requests admitted at once


class Scheduler:
    def __init__(self, config: EngineConfig, facts: ModelFacts, executor: StepExecutor) -> None:
        self.config = config
        self.facts = facts
        self.executor = executor
        self.page_size = facts.page_size
        self.kv = KVManager(
            facts.num_pages,
            facts.page_size,
            config.max_running_requests,
            -(-facts.max_model_len // facts.page_size),
            config.cache,
        )
        self.sampling = SamplingBatchBuilder(facts.vocab_size, facts.eos_token_ids, config.seed)
        self.eos_token_ids = frozenset(facts.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._next_step = 0
        self._admissions = 0
        self._wake: asyncio.Event | None = None
        self._stopping = False

    # -- public API (call on the loop's thread) ----------------------------

    def validate(self, prompt_len: int, max_tokens: int | None) -> int:
        """The number of tokens a request may generate; RequestRejected if it
        can never run."""
        limit = self.facts.max_model_len
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if prompt_len >= limit:
            raise RequestRejected(
                f"this model's maximum context length is {limit} tokens, "
                f"but the prompt has {prompt_len} tokens",
                "prompt",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise RequestRejected(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len} tokens and max_tokens asks for {max_tokens} more",
                "max_tokens",
            )
        needed = self.kv.pages_for(prompt_len + 1)
        if needed > self.kv.num_usable_pages:
            raise RequestRejected(
                f"the prompt needs {needed} KV pages but the pool has {self.kv.num_usable_pages}",
                "prompt",
            )
        return min(max_tokens or limit, limit - prompt_len)

    def submit(self, request: Request) -> None:
        if request.rid in self.requests:
            raise RequestRejected(f"request id {request.rid!r} is already in use", "request_id")
        request.max_new_tokens = self.validate(len(request.prompt_ids), request.params.max_tokens)
        if request.params.prompt_logprobs is not None and not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # the first token has no logprob
        self.requests[request.rid] = request
        self.waiting.append(request)
        self._notify()

    def abort(self, rid: str, reason: str = "abort") -> bool:
        """End a request now and free what it holds; its consumer gets a last
        event with `reason`. Consumers that match stop strings end requests
        this way with reason "stop". Steps already in flight may still write
        to the old pages; only later steps can reuse them."""
        request = self.requests.get(rid)
        if request is None:
            return False
        self._finish(request, reason)
        if reason == "abort":
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        request.sink(RequestEvent(finish_reason=reason))
        self._notify()
        return True

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run."""
        if self.running or self.waiting:
            return False
        freed = self.kv.flush()
        logger.info("flushed the prefix cache (%d pages)", freed)
        return True

    def check_integrity(self) -> None:
        self.kv.check_integrity(
            [r.own_pages for r in self.running], [r.slot for r in self.running]  # type: ignore[misc]
        )

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stop(self) -> None:
        self._stopping = True
        self._notify()

    # -- the loop ------------------------------------------------------------

    async def run(self, until_idle: bool = False) -> None:
        """Schedule and execute steps until stop() (or, with until_idle, until
        nothing is left to do)."""
        self._wake = asyncio.Event()
        self._stopping = False
        inflight: tuple[ScheduledStep, asyncio.Future[StepOutput]] | None = None
        while not self._stopping:
            self._wake.clear()
            try:
                step = self.schedule()
            except Exception:  # a bug must not take the server down: fail what runs, go on
                logger.exception("scheduling failed; failing all requests")
                self._fail_all("internal scheduler error")
                step = None
            future = self.executor.submit(step.plan) if step else None
            previous, inflight = inflight, ((step, future) if step else None)  # type: ignore[assignment]
            if previous is not None:
                await self._complete(*previous)
            if inflight is not None and not self.config.overlap:
                await self._complete(*inflight)
                inflight = None
            if step is None and previous is None:
                # Nothing ran and nothing could start: sleep until a submit or abort.
                if not self.has_work:
                    if self.config.debug_integrity:
                        self.check_integrity()
                    if until_idle:
                        break
                await self._wake.wait()
        if inflight is not None:
            await self._complete(*inflight)

    async def _complete(self, step: ScheduledStep, future: "asyncio.Future[StepOutput]") -> None:
        try:
            output = await future
        except Exception as exc:  # a failed forward fails its requests, not the loop
            logger.exception("step %d failed", step.plan.step)
            for entry in step.entries:
                request = entry.request
                if not request.finished:
                    self._finish(request, "error")
                    request.sink(RequestEvent(finish_reason="error", error=f"forward failed: {exc}"))
            return
        try:
            self.process(step, output)
        except Exception:
            logger.exception("processing step %d failed; failing all requests", step.plan.step)
            self._fail_all("internal scheduler error")

    def _fail_all(self, message: str) -> None:
        for request in list(self.running) + list(self.waiting):
            self._finish(request, "error")
            request.sink(RequestEvent(finish_reason="error", error=message))

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- planning a step -----------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        step_id = self._next_step
        builder = PlanBuilder(step_id, self.page_size, self.kv.table, self.sampling)
        for request in self._reserve_decode_pages([r for r in self.running if self._can_decode(r, step_id)]):
            self._add_decode(builder, request, step_id)
        budget = self.config.max_prefill_tokens
        for request in [r for r in self.running if r.is_prefilling]:
            if budget <= 0:
                break
            budget -= self._add_chunk(builder, request, budget, step_id)
        while self.waiting and budget > 0 and self._admit(self.waiting[0]):
            budget -= self._add_chunk(builder, self.waiting.popleft(), budget, step_id)
        if not builder.entries:
            return None
        self._next_step += 1
        step = builder.build()
        self.stats.steps += 1
        self.stats.prefill_tokens += step.num_prefill_tokens
        if step.num_prefill_tokens:
            self.stats.last_prefill_tokens = step.num_prefill_tokens
        return step

    def _can_decode(self, request: Request, step_id: int) -> bool:
        if request.is_prefilling or request.num_generated >= request.max_new_tokens:
            return False  # a request at its limit finishes once its pending token lands
        # A pending token is only reachable as a placeholder from the very next step.
        return request.num_pending == 0 or request.last_step == step_id - 1

    def _reserve_decode_pages(self, decoders: list[Request]) -> list[Request]:
        """Give each decoder whose next token starts a page a new page;
        preempt the newest requests while the pool cannot."""
        ps = self.page_size
        while True:
            needy = [r for r in decoders if r.kv_len // ps >= len(r.pages)]
            if len(needy) <= self.kv.num_available_pages or not self.running:
                break
            victim = max(self.running, key=lambda r: r.admitted_seq)
            self._preempt(victim)
            decoders = [r for r in decoders if r is not victim]
        for request in needy:
            pages = self.kv.allocate(1)
            if pages is None:  # cannot happen after the loop above; keep the invariant loud
                raise RuntimeError("KV pool exhausted after preemption")
            self.kv.table.write(request.slot, len(request.pages), pages)  # type: ignore[arg-type]
            request.pages += pages
        return decoders

    def _add_decode(self, builder: PlanBuilder, request: Request, step_id: int) -> None:
        placeholder = -(request.last_row + 1) if request.num_pending else None
        token = placeholder if placeholder is not None else request.all_ids[-1]
        sample = SampleRow(request, request.num_generated, placeholder)
        entry = builder.add(request, [token], request.kv_len, sample, decode=True)
        self._mark_sampled(request, entry, step_id)
        request.kv_len += 1

    def _add_chunk(self, builder: PlanBuilder, request: Request, budget: int, step_id: int) -> int:
        """Add the next prefill chunk of `request`; returns its token count."""
        start = request.kv_len
        end = min(len(request.all_ids), start + budget)
        final = end == len(request.all_ids)
        sample = SampleRow(request, request.num_generated, None) if final else None
        targets = None
        if request.wants_prompt_logprobs:
            last = min(end, request.num_prompt_tokens - 1)
            targets = request.prompt_ids[start + 1 : last + 1]
        entry = builder.add(request, request.all_ids[start:end], start, sample, decode=False, prompt_lp_targets=targets)
        request.kv_len = end
        if final:
            self._mark_sampled(request, entry, step_id)
        return end - start

    @staticmethod
    def _mark_sampled(request: Request, entry: StepEntry, step_id: int) -> None:
        request.num_pending += 1
        request.last_step = step_id
        request.last_row = entry.row  # type: ignore[assignment]

    def _admit(self, request: Request) -> bool:
        """Give `request` a slot and KV pages for its whole prompt, if the
        pool can also keep room for it (and the running requests) to decode."""
        if request.num_pending or self.kv.table.num_free_slots == 0:
            return False
        kv = self.kv
        tokens = request.all_ids
        match = PrefixMatch([], 0) if request.wants_prompt_logprobs else kv.match_and_lock(tokens)
        need = kv.pages_for(len(tokens)) - len(match.pages)
        decode_room = min(request.max_new_tokens - request.num_generated, self.config.decode_reserve_tokens)
        reserve = kv.pages_for(len(tokens) + decode_room) - kv.pages_for(len(tokens)) + len(self.running)
        fits = kv.num_available_pages >= need + (reserve if self.running else 0)
        pages = kv.allocate(need) if fits else None
        if pages is None:
            kv.cache.unlock(match)
            return False
        self._admissions += 1
        request.slot = kv.table.alloc_slot()
        request.pages = match.pages + pages
        kv.table.write(request.slot, 0, request.pages)  # type: ignore[arg-type]
        request.prefix = match
        request.kv_len = request.kv_done = match.num_tokens
        request.admitted_seq = self._admissions
        request.status = Status.RUNNING
        if request.num_cached_tokens is None:
            request.num_cached_tokens = match.num_tokens
            self.stats.cached_tokens += match.num_tokens
            self.stats.prompt_tokens += request.num_prompt_tokens
        self.running.append(request)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return True

    # -- releasing -------------------------------------------------------------

    def _release(self, request: Request) -> None:
        self.kv.release(request.all_ids, request.pages, request.prefix, request.kv_done, request.slot)  # type: ignore[arg-type]
        self.running.remove(request)
        request.slot, request.pages, request.prefix = None, [], None
        request.kv_len = request.kv_done = 0

    def _share_prompt_pages(self, request: Request) -> None:
        """Prompt pages go to the prefix cache as soon as they are computed."""
        request.pages, request.prefix = self.kv.share_computed(
            request.all_ids, request.pages, request.prefix, request.kv_done, request.slot  # type: ignore[arg-type]
        )

    def _preempt(self, request: Request) -> None:
        """Free a running request's KV and queue it first, to recompute later
        (its computed pages go to the prefix cache, so often little is lost)."""
        self._release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(request)
        logger.info(
            "preempted request %s (%d tokens) to free KV pages; %d preemptions so far",
            request.rid, request.seq_len, self.stats.preemptions,
        )

    def _finish(self, request: Request, reason: str) -> None:
        if request.status is Status.RUNNING:
            self._release(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.rid, None)

    # -- processing a step's output --------------------------------------------

    def process(self, step: ScheduledStep, output: StepOutput) -> None:
        tokens = output.next_token_ids.tolist()
        logprobs = output.logprobs.tolist()
        top_ids = output.top_ids.tolist() if output.top_ids is not None else None
        top_lps = output.top_logprobs.tolist() if output.top_logprobs is not None else None
        for entry in step.entries:
            request = entry.request
            if entry.row is not None:
                request.num_pending -= 1
            if request.finished:
                continue
            if request.status is Status.RUNNING and entry.admission == request.admitted_seq:
                request.kv_done = max(request.kv_done, entry.kv_len_after)
                if entry.prefill:
                    self._share_prompt_pages(request)
            if entry.prompt_logprob_span is not None:
                self._record_prompt_logprobs(request, entry, output)
            if entry.row is None:
                continue
            row = entry.row
            token = tokens[row]
            request.all_ids.append(token)
            request.output_logprobs.append(logprobs[row])
            self.stats.generated_tokens += 1
            top = None
            wanted = request.params.logprobs
            if wanted and top_ids is not None:
                top = list(zip(top_ids[row][:wanted], top_lps[row][:wanted]))  # type: ignore[index]
            reason = self._stop_reason(request, token)
            event = RequestEvent(token_id=token, logprob=logprobs[row], top_logprobs=top, finish_reason=reason)
            if not request.first_event_sent:
                request.first_event_sent = True
                event.num_prompt_tokens = request.num_prompt_tokens
                event.num_cached_tokens = request.num_cached_tokens
                if request.params.prompt_logprobs is not None:
                    event.prompt_logprobs = request.prompt_logprobs
            if reason is not None:
                self._finish(request, reason)
                self.stats.finished += 1
            request.sink(event)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if request.num_output_tokens >= request.max_new_tokens:
            return "length"
        return None

    @staticmethod
    def _record_prompt_logprobs(request: Request, entry: StepEntry, output: StepOutput) -> None:
        first, count = entry.prompt_logprob_span  # type: ignore[misc]
        for i in range(count):
            # Position p's logits give the logprob of prompt token p + 1; a
            # recomputed chunk (after preemption) may repeat positions already had.
            if entry.first_position + i + 1 != len(request.prompt_logprobs):
                continue
            top: list[tuple[int, float]] = []
            if output.prompt_top_ids is not None:
                wanted = request.params.prompt_logprobs or 0
                top = list(zip(output.prompt_top_ids[first + i, :wanted].tolist(), output.prompt_top_logprobs[first + i, :wanted].tolist()))  # type: ignore[index]
            request.prompt_logprobs.append((float(output.prompt_logprobs[first + i]), top))  # type: ignore[index]
