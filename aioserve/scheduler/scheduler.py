"""The scheduler: its public calls and its async loop.

`run()` plans a step (planner.py), submits it to the executor and processes
the previous step's output (output_processor.py). With overlap it plans and
launches step N+1 before it waits for step N, then processes N's tokens
while N+1 runs; plans refer to not-yet-known tokens by placeholder
(aioserve/placeholders.py). Where requests are and how they move lives in
request_table.py, KV memory in kvcache/manager.py. Everything here runs on
the event loop's thread: submit and abort are plain calls.

Faults end requests, never the loop: a forward that raises fails the
requests of its step; a bug while planning or processing fails every
request; a failed KV integrity check (`--debug-integrity` when idle, or
after such a bug) fails the running requests and starts the KV bookkeeping
afresh, so the server keeps serving and no consumer waits forever.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aioserve.batch_plan import StepOutput
from aioserve.config import EngineConfig
from aioserve.engine.executor import StepExecutor, TensorParallelFailure
from aioserve.kvcache.manager import KVManager
from aioserve.cpu.openmp import this_thread_single_threaded
from aioserve.scheduler.adapters import Adapter, AdapterTable
from aioserve.scheduler.client import LoraInfo, SchedulerInfo
from aioserve.scheduler.output_processor import OutputProcessor
from aioserve.scheduler.plan_builder import ScheduledStep
from aioserve.scheduler.planner import StepPlanner
from aioserve.scheduler.request import Request, RequestEvent, RequestRejected, SpeculativeCounts
from aioserve.scheduler.request_table import RequestTable, SchedulerStats
from aioserve.scheduler.sampling_batch import SamplingBatchBuilder
from aioserve.scheduler.speculation import Speculator
from aioserve.lora_config import AdapterError, resolve_lora
from aioserve.pooling_config import PoolerConfig
from aioserve.speculative_config import resolve_speculative

logger = logging.getLogger(__name__)

__all__ = ["ModelFacts", "Scheduler", "SchedulerStats"]


@dataclass
class ModelFacts:
    """What the scheduler must know of the engine."""

    num_pages: int
    page_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_prefill_tokens: int  # the config's, or the engine's default for its device
    pooler: PoolerConfig | None = None  # a pooling model's pooling: it takes pooling requests only
    # With LoRA served: the engine reads an adapter into host memory (id, path),
    # and lets an unloaded one's copy go (lora/adapter_slots.py).
    read_adapter: Callable[[int, str], None] | None = None
    forget_adapter: Callable[[int], None] | None = None
    takes_images: bool = False  # a vision-language model: requests may carry images


class Scheduler:
    def __init__(self, config: EngineConfig, facts: ModelFacts, executor: StepExecutor) -> None:
        self.config = config
        self.facts = facts
        self.executor = executor
        # Built on the event loop's thread, which must start no OpenMP team
        # (aioserve/cpu/openmp.py): zeroing a long-context page table (Qwen3:
        # 256 x 2560 slots) ran in parallel and left a second team, and the
        # forward's regions then waited for wake-ups (a Qwen3-0.6B decode
        # step ~30 -> ~45 ms).
        with this_thread_single_threaded():
            self.kv = self._new_kv()
        lora = self.lora = resolve_lora(config)
        self.adapters: AdapterTable | None = None
        if lora is not None:
            assert facts.read_adapter is not None and facts.forget_adapter is not None
            self.adapters = AdapterTable(lora.max_loras, facts.forget_adapter)
        self.table = RequestTable(self.kv, self.adapters)
        sampling = SamplingBatchBuilder(facts.vocab_size, facts.eos_token_ids, config.seed)
        speculative = resolve_speculative(config)
        self.speculator = Speculator(speculative) if speculative is not None else None
        self.planner = StepPlanner(config, self.table, self.kv, sampling, facts.max_prefill_tokens, self.speculator)
        self.outputs = OutputProcessor(self.table, facts.eos_token_ids, self.speculator)
        self._next_step = 0
        self._wake: asyncio.Event | None = None
        self._stopping = False
        # Integrity checks that failed (each followed by a reset of the KV
        # bookkeeping); /server_info keeps reporting the last one.
        self.integrity_failures: list[str] = []

    def _new_kv(self) -> KVManager:
        facts, config = self.facts, self.config
        return KVManager(
            facts.num_pages,
            facts.page_size,
            config.max_running_requests,
            -(-facts.max_model_len // facts.page_size),
            config.cache,
        )

    @property
    def stats(self) -> SchedulerStats:
        return self.table.stats

    @property
    def running(self) -> list[Request]:
        return self.table.running

    @property
    def waiting(self) -> deque[Request]:
        return self.table.waiting

    @property
    def num_waiting(self) -> int:
        return len(self.table.waiting)

    # -- public API (call on the loop's thread) ----------------------------

    def validate(self, prompt_len: int, max_tokens: int | None) -> int:
        """The number of tokens a request may generate; RequestRejected if it
        can never run.

        Besides the context, a request is bounded by what the KV pool can
        ever hold: one that grew past it could never be readmitted after a
        preemption and would block the queue. It ends with "length" there."""
        limit = self.facts.max_model_len
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if prompt_len > limit or (prompt_len == limit and max_tokens != 0):  # max_tokens 0: the prompt alone
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
        pool_tokens = self.kv.num_usable_pages * self.kv.page_size
        allowed = min(limit, pool_tokens) - prompt_len
        return allowed if max_tokens is None else min(max_tokens, allowed)

    # -- LoRA adapters ------------------------------------------------------------

    @property
    def serves_adapters(self) -> bool:
        return self.adapters is not None

    def adapter(self, name: str) -> Adapter | None:
        """The loaded adapter of that name (None: none is)."""
        return self.adapters.by_name.get(name) if self.adapters is not None else None

    def _adapter_table(self) -> AdapterTable:
        if self.adapters is None:
            raise AdapterError("LoRA adapters are not served: start the server with --enable-lora")
        return self.adapters

    def load_adapter_now(self, name: str, path: str) -> Adapter:
        """Read and register an adapter on this thread (the ones named at start)."""
        table = self._adapter_table()
        table.check_free(name)
        adapter_id = table.new_id()
        assert self.facts.read_adapter is not None
        self.facts.read_adapter(adapter_id, path)
        return table.register(adapter_id, name, path)

    async def load_adapter(self, name: str, path: str) -> Adapter:
        """Read and check an adapter off the event loop, then register it:
        AdapterError (a 400) for a name in use or an adapter not servable."""
        table = self._adapter_table()
        table.check_free(name)
        adapter_id = table.new_id()
        assert self.facts.read_adapter is not None
        await asyncio.to_thread(_single_threaded, self.facts.read_adapter, adapter_id, path)
        try:
            adapter = table.register(adapter_id, name, path)
        except AdapterError:  # loaded meanwhile by another call: this read goes
            assert self.facts.forget_adapter is not None
            self.facts.forget_adapter(adapter_id)
            raise
        logger.info("LoRA adapter `%s` loaded from %s", name, path)
        return adapter

    def unload_adapter(self, name: str) -> bool:
        """Take an adapter's name away (False: no such adapter): new requests
        cannot name it; those under way finish on it."""
        adapter = self._adapter_table().unregister(name)
        if adapter is not None:
            logger.info("LoRA adapter `%s` unloaded (%d requests finish on it)", name, adapter.requests)
        return adapter is not None

    def adapter_names(self) -> list[str]:
        return list(self.adapters.by_name) if self.adapters is not None else []

    def submit(self, request: Request) -> None:
        self.submit_all([request])

    def submit_all(self, requests: list[Request]) -> None:
        """Check every request, then queue them all: a bad one (SamplingParamsError
        or RequestRejected, both ValueErrors naming the field) leaves nothing
        queued. The one place a request is validated, for HTTP and offline alike."""
        # Linear in the prompts, not prompts × n: a choice's prompt is often
        # its siblings' very list, checked once (by min and max, in C); n=128
        # of a 32k-token prompt took the event loop 0.4 s id by id.
        seen: set[str] = set()
        checked: set[int] = set()
        for request in requests:
            if request.rid in self.table.by_id or request.rid in seen:
                raise RequestRejected(f"request id {request.rid!r} is already in use", "request_id")
            seen.add(request.rid)
            self._check_kind(request)
            if request.adapter is not None and (request.adapter.unloaded or self.adapters is None):
                raise RequestRejected(f"the LoRA adapter `{request.adapter.name}` is not loaded", "model")
            if request.images is not None:
                self._check_images(request)
            request.params.validate(self.facts.vocab_size)
            ids = request.prompt_ids
            if id(ids) not in checked and ids and (min(ids) < 0 or max(ids) >= self.facts.vocab_size):
                raise RequestRejected(f"prompt token ids must be in [0, {self.facts.vocab_size})", "prompt")
            checked.add(id(ids))
            request.max_new_tokens = self.validate(len(request.prompt_ids), request.params.max_tokens)
        for request in requests:
            self._queue(request)

    def _check_images(self, request: Request) -> None:
        """Images only for a model that reads them, at their placeholders."""
        images = request.images
        assert images is not None
        if not self.facts.takes_images:
            raise RequestRejected("this model does not take images: it is a text model", "messages")
        if images.spans and images.spans[-1].end > len(request.prompt_ids):
            raise RequestRejected("an image's placeholder tokens run past the prompt", "prompt")
        if images.mrope is not None and images.mrope.shape[1] != len(request.prompt_ids):
            raise RequestRejected("the prompt's M-RoPE positions do not cover it", "prompt")
        for span in images.spans:
            if span.bidirectional and span.image.num_tokens > self.facts.max_prefill_tokens:
                raise RequestRejected(
                    f"an image of {span.image.num_tokens} tokens cannot be computed in one chunk of "
                    f"{self.facts.max_prefill_tokens} (--max-prefill-tokens)", "messages",
                )

    def _check_kind(self, request: Request) -> None:
        """A pooling model pools and a generating one generates (the server
        routes refuse the other kind first, with the flag to use)."""
        pooler = self.facts.pooler
        if pooler is None and request.pooling is not None:
            raise RequestRejected("this model generates text: it is not served as a pooling model (--runner pooling)")
        if pooler is not None and request.pooling is None:
            raise RequestRejected("this model is served as a pooling model: it cannot generate (--runner generate)")
        if request.pooling is not None and request.pooling.score and pooler is not None and pooler.task != "classify":
            raise RequestRejected("this model embeds: it has no score head to rerank or score with")
        if request.pooling is not None and request.params.max_tokens != 0:
            raise RequestRejected("a pooling request generates nothing: max_tokens must be 0", "max_tokens")

    def _queue(self, request: Request) -> None:
        if self.speculator is not None and request.speculation is None:
            request.speculation = SpeculativeCounts()
        if request.grammar is not None and request.constraint is None:
            request.constraint = request.grammar.new_constraint(self._stop_token_ids(request))
        if request.params.prompt_logprobs is not None and not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # the first token has no logprob
        self.table.add(request)
        self._notify()

    def _stop_token_ids(self, request: Request) -> list[int]:
        """The tokens that may end a constrained output once its grammar is complete."""
        params = request.params
        eos = [] if params.ignore_eos else self.facts.eos_token_ids
        return sorted(set(params.stop_token_ids) | set(eos))

    def abort(self, rid: str, reason: str = "abort") -> bool:
        """End a request now and free what it holds; its consumer gets a last
        event with `reason`. Consumers that match stop strings end requests
        this way with reason "stop". Steps already in flight may still write
        to the old pages; only later steps can reuse them."""
        request = self.table.by_id.get(rid)
        if request is None:
            return False
        self.table.finish(request, reason)
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
        self.kv.check_integrity([r.admitted_kv for r in self.running])

    def info(self, check_integrity: bool = False) -> SchedulerInfo:
        kv = self.kv
        integrity = "not checked"
        if check_integrity:  # O(pages): for /server_info, not for every metrics scrape
            try:
                self.check_integrity()
                integrity = "ok"
            except AssertionError as exc:
                integrity = str(exc)
            if integrity == "ok" and self.integrity_failures:
                integrity = f"reset after a failed check: {self.integrity_failures[-1]}"
        return SchedulerInfo(
            running=len(self.running),
            waiting=len(self.waiting),
            page_size=kv.page_size,
            kv_pages_total=kv.num_usable_pages,
            kv_pages_free=kv.allocator.num_free,
            kv_pages_cached=kv.cache.num_pages,
            kv_pages_evictable=kv.cache.num_evictable_pages,
            kv_integrity=integrity,
            max_prefill_tokens=self.facts.max_prefill_tokens,
            stats=dict(vars(self.stats)),
            speculation=copy.deepcopy(self.speculator.stats) if self.speculator is not None else None,
            avg_spec_accept_length=self.speculator.stats.mean_acceptance_length if self.speculator else None,
            lora=self._lora_info(),
        )

    def _lora_info(self) -> LoraInfo | None:
        table = self.adapters
        if table is None:
            return None

        def per_adapter(requests: Iterable[Request]) -> dict[str, int]:
            return dict(Counter(r.adapter.name for r in requests if r.adapter is not None))

        assert self.lora is not None  # set with the table
        return LoraInfo(
            max_loras=table.max_loras, max_lora_rank=self.lora.max_lora_rank, max_cpu_loras=self.lora.max_cpu_loras,
            adapters={name: adapter.path for name, adapter in table.by_name.items()},
            running=per_adapter(self.running), waiting=per_adapter(self.waiting),
            slots_in_use=table.slots_in_use, evictions=table.evictions,
        )

    def shutdown(self) -> None:
        """Stop the executor's threads (after the loop has ended)."""
        self.executor.shutdown()

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
        with this_thread_single_threaded():  # the loop's thread: see aioserve/cpu/openmp.py
            await self._run(until_idle)

    async def _run(self, until_idle: bool) -> None:
        self._wake = asyncio.Event()
        self._stopping = False
        inflight: tuple[ScheduledStep, asyncio.Future[StepOutput]] | None = None
        while not self._stopping:
            self._wake.clear()
            if inflight is not None and self.planner.waits_for_tokens():
                # Decoders need the in-flight step's tokens (grammar masks,
                # proposals): let it land first rather than skip them in this step.
                self.stats.token_waits += 1
                await self._complete(*inflight)
                inflight = None
            try:
                step = self.schedule()
            except Exception:  # a bug must not take the server down: fail what runs, go on
                logger.exception("scheduling failed; failing all requests")
                self._fail_all("internal scheduler error")
                step = None
            previous, inflight = inflight, ((step, self.executor.submit(step.plan)) if step else None)
            if previous is not None:
                await self._complete(*previous)
            if inflight is not None and not self.config.overlap:
                await self._complete(*inflight)
                inflight = None
            if step is None and previous is None:
                # Nothing ran and nothing could start: sleep until a submit or abort.
                if not self.has_work:
                    if self.config.debug_integrity:  # O(pages): when idle, not per step
                        self._check_integrity_or_reset()
                    if until_idle:
                        break
                await self._wake.wait()
        if inflight is not None:
            await self._complete(*inflight)

    async def _complete(self, step: ScheduledStep, future: "asyncio.Future[StepOutput]") -> None:
        try:
            output = await future
        except Exception as exc:  # a failed forward fails its requests, not the loop
            if isinstance(exc, TensorParallelFailure):  # a rank went away: no traceback of ours to show
                logger.error("step %d failed: %s", step.plan.step, exc)
            else:
                logger.exception("step %d failed", step.plan.step)
            for entry in step.entries:
                if not entry.request.finished:
                    self._fail(entry.request, f"forward failed: {exc}")
            if self.adapters is not None and step.plan.lora is not None:
                self.adapters.loads_failed(step.plan.lora.loads)
            return
        self.stats.steps_done += 1
        try:
            self.outputs.process(step, output)
        except Exception:
            logger.exception("processing step %d failed; failing all requests", step.plan.step)
            self._fail_all("internal scheduler error")

    def _fail_all(self, message: str) -> None:
        """End every request with an error. A bug may have left the KV
        bookkeeping inconsistent: if the check then fails, it starts afresh."""
        for request in list(self.running) + list(self.waiting):
            self._fail(request, message)
        self._check_integrity_or_reset()

    def _fail(self, request: Request, message: str) -> None:
        event = RequestEvent(finish_reason="error", error=message)
        try:
            self.table.finish(request, "error", event)
            return
        except Exception:  # releasing its KV failed: the bookkeeping is broken
            logger.exception("ending request %s failed; dropping it", request.rid)
        # The KV it held is reclaimed by the reset that follows a failed check.
        self.table.drop(request, event)

    def _check_integrity_or_reset(self) -> None:
        """Check the KV bookkeeping; when it is broken, end every running
        request with an error and replace the bookkeeping with a fresh one
        (every page free, the prefix cache empty, every slot free), so later
        requests are served correctly. A step still in flight may write into
        pages the fresh pool hands out; only steps after it can use them, and
        steps run in order."""
        try:
            self.check_integrity()
            return
        except Exception as exc:  # AssertionError, or whatever broken structures raise
            message = str(exc) or type(exc).__name__
        logger.error("KV integrity check failed (%s): failing the running requests and resetting the KV state", message)
        self.integrity_failures.append(message)
        # Running requests hold KV of the broken state; waiting ones hold none
        # and are served from the fresh one.
        for request in list(self.running):
            self._fail(request, f"KV integrity check failed: {message}")
        with this_thread_single_threaded():  # zeroing the page table: see __init__
            self.kv.reset()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- planning a step -----------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        step = self.planner.plan(self._next_step)
        if step is None:
            return None
        self._next_step += 1
        stats = self.stats
        stats.steps += 1
        stats.prefill_tokens += step.num_prefill_tokens
        if step.num_prefill_tokens:
            stats.last_prefill_tokens = step.num_prefill_tokens
        return step


def _single_threaded(read: Callable[[int, str], None], adapter_id: int, path: str) -> None:
    """Read an adapter on a pool thread without starting an OpenMP team
    there (cpu/openmp.py: a second team slows every forward)."""
    with this_thread_single_threaded():
        read(adapter_id, path)
