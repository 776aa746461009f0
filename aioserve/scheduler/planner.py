"""Planning one step, in three phases read top to bottom:

1. **decodes**: every running request whose prompt is computed gets one
   token (a grammar-constrained one only once its previous token has
   landed: its mask is built from it). When its next token starts a page it gets a new page first; while
   the pool cannot give those, the newest request is preempted. With
   speculative decoding, those with a proposal verify it instead
   (speculation.py), after the plain decodes.
2. **chunks of prompts under way**, up to `max_prefill_tokens` in all.
3. **admissions**: waiting requests in arrival order, while the budget, a
   slot and the pool (prompt + a decode reserve for it and for every running
   request) allow. A request that cannot be admitted even with nothing
   running never could be; it ends instead of blocking the queue.

The result is a ScheduledStep: the BatchPlan of plain tensors, plus what the
output processor needs to know about each of its entries.
"""

from __future__ import annotations

import logging

from aioserve.config import EngineConfig
from aioserve.image_inputs import PromptImages
from aioserve.kvcache.manager import KVManager
from aioserve.scheduler.plan_builder import PlanBuilder, ScheduledStep, StepEntry
from aioserve.scheduler.request import Request, RequestEvent
from aioserve.scheduler.request_table import RequestTable
from aioserve.scheduler.sampling_batch import SampleRow, SamplingBatchBuilder
from aioserve.scheduler.speculation import Speculator

logger = logging.getLogger(__name__)


class StepPlanner:
    def __init__(
        self,
        config: EngineConfig,
        table: RequestTable,
        kv: KVManager,
        sampling: SamplingBatchBuilder,
        max_prefill_tokens: int,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self.speculator = speculator
        self.max_prefill_tokens = max_prefill_tokens
        self.table = table
        self.kv = kv
        self.sampling = sampling

    def plan(self, step_id: int) -> ScheduledStep | None:
        builder = PlanBuilder(step_id, self.kv.page_size, self.kv.table, self.sampling, images=self.table.images,
                              track_following=self.speculator is not None and self.speculator.follows_target)
        self._plan_decodes(builder, step_id)
        budget = self._plan_running_chunks(builder, self.max_prefill_tokens, step_id)
        self._plan_admissions(builder, budget, step_id)
        if not builder.entries:
            return None
        adapters = self.table.adapters
        return builder.build(adapters.take_loads() if adapters is not None else None, self.table.images.take())

    # -- phase 1: decodes --------------------------------------------------------

    def _plan_decodes(self, builder: PlanBuilder, step_id: int) -> None:
        decoders = self._reserve_pages([r for r in self.table.running if self._can_decode(r, step_id)])
        drafts = self.speculator.drafts(decoders, self.kv) if self.speculator is not None else {}
        for request in decoders:
            if request in drafts:
                continue
            placeholder = request.pending.placeholder_for(step_id)
            token = placeholder if placeholder is not None else request.all_ids[-1]
            sample = SampleRow(request, request.num_generated, placeholder)
            entry = builder.add(request, [token], request.kv_len, sample, decode=True)
            request.admitted_kv.scheduled(request.kv_len + 1)
            self._mark_sampled(request, entry, step_id)
        in_engine = self.speculator is not None and self.speculator.proposes_in_engine
        for request, draft in drafts.items():
            self._add_verify(builder, request, draft, step_id, in_engine)

    @staticmethod
    def _add_verify(builder: PlanBuilder, request: Request, draft: list[int], step_id: int, in_engine: bool) -> None:
        """Verify `draft`: every position is sampled as a decode would be,
        penalties counting the proposed tokens before it. `in_engine`: the
        draft holds placeholders the engine's draft model fills (such
        requests have no penalty or grammar reading them)."""
        first = request.num_generated
        samples = [
            SampleRow(request, first + i, None, () if in_engine else tuple(draft[:i])) for i in range(len(draft) + 1)
        ]
        entry = builder.add_verify(request, draft, samples, in_engine)
        request.admitted_kv.scheduled(request.kv_len + len(draft) + 1)
        assert entry.row is not None
        request.pending.sampled(step_id, entry.row, nameable=False)

    def waits_for_tokens(self) -> bool:
        """Whether the loop should let the step in flight land before planning
        the next. Requests whose next plan needs that step's tokens (a
        grammar's mask; a proposal, which is made from the newest token) would
        otherwise sit the step out: when speculation is on at this batch
        size and one of them would propose (not backing off), or at least
        half of the decoders are constrained with a token in flight, waiting
        gives up overlap for one step but keeps every request going. With few such requests among many free ones, skipping
        them is the cheaper of the two."""
        decoding = [r for r in self.table.running if not r.is_prefilling]
        in_flight = [r for r in decoding if r.pending.count]
        speculator = self.speculator
        if speculator is not None and speculator.active_for(len(decoding)):
            if any(speculator.would_propose(r) for r in in_flight):
                return True
        waiting = sum(1 for r in in_flight if r.is_constrained or not r.pending.nameable)
        return waiting > 0 and 2 * waiting >= len(decoding)

    @staticmethod
    def _can_decode(request: Request, step_id: int) -> bool:
        if request.is_prefilling or request.num_generated >= request.max_new_tokens:
            return False  # a request at its limit finishes once its pending token lands
        if request.is_constrained and request.pending.count:
            # Its grammar mask depends on the token in flight: wait for it to
            # land (the next step), so the mask is exact when the plan is built.
            return False
        return request.pending.reachable_from(step_id)

    def _reserve_pages(self, decoders: list[Request]) -> list[Request]:
        """Give each decoder the page its next token needs, preempting the
        newest running requests while the pool cannot; returns the decoders
        still running."""
        while True:
            # Most decoders have room on their last page (15 steps of 16):
            # only those short of a page are extended below.
            short = [(r, n) for r in decoders if (n := self.kv.pages_short(r.admitted_kv, r.kv_len + 1))]
            if sum(n for _, n in short) <= self.kv.num_available_pages or not self.table.running:
                break
            victim = self.table.running[-1]
            self.table.preempt(victim)
            decoders = [r for r in decoders if r is not victim]
        for request, _ in short:
            if not self.kv.extend(request.admitted_kv, request.kv_len + 1):
                raise RuntimeError("KV pool exhausted after preemption")  # the loop above rules it out
        return decoders

    # -- phase 2: prompts under way ------------------------------------------------

    def _plan_running_chunks(self, builder: PlanBuilder, budget: int, step_id: int) -> int:
        for request in [r for r in self.table.running if r.is_prefilling]:
            if budget <= 0:
                break
            budget -= self._add_chunk(builder, request, budget, step_id)
        return budget

    def _add_chunk(self, builder: PlanBuilder, request: Request, budget: int, step_id: int) -> int:
        """Add the next prefill chunk of `request`; returns its token count.
        The chunk that completes the sequence samples the next token (unless
        the request asked for none: it only wanted its prompt scored)."""
        start = request.kv_len
        end = min(len(request.all_ids), start + budget)
        if end < len(request.all_ids) and request.pooling is not None and not request.pooling.causal:
            return 0  # an encoder's prompt is computed whole (its attention sees all of it): a later step
        if request.images is not None:
            end = whole_images_end(request.images, start, end)
        samples = end == len(request.all_ids) and request.max_new_tokens > 0
        sample = SampleRow(request, request.num_generated, None) if samples else None
        targets = None
        if request.wants_prompt_logprobs:
            last = min(end, request.num_prompt_tokens - 1)
            targets = request.prompt_ids[start + 1 : last + 1]
        entry = builder.add(request, request.all_ids[start:end], start, sample, decode=False, prompt_lp_targets=targets)
        request.admitted_kv.scheduled(end)
        if samples:
            self._mark_sampled(request, entry, step_id)
        return end - start

    @staticmethod
    def _mark_sampled(request: Request, entry: StepEntry, step_id: int) -> None:
        assert entry.row is not None
        request.pending.sampled(step_id, entry.row)

    # -- phase 3: admissions ---------------------------------------------------------

    def _plan_admissions(self, builder: PlanBuilder, budget: int, step_id: int) -> None:
        waiting = self.table.waiting
        while waiting and budget > 0:
            request = waiting[0]
            if request.pending.count:  # preempted with a token still in flight: next step
                return
            if not self._admit(request):
                if not self.table.running:
                    self._end_unadmittable(request)
                    continue
                return
            added = self._add_chunk(builder, request, budget, step_id)
            if not added:  # admitted, but its prompt waits for a step with room for all of it
                return
            budget -= added

    def _admit(self, request: Request) -> bool:
        """Admit `request` if the pool holds its whole sequence and can also
        keep room for it and for each running request to decode."""
        tokens = request.cache_ids  # an image's tokens keyed by its content
        headroom = 0
        if self.table.running:
            decode_room = min(request.max_new_tokens - request.num_generated, self.config.decode_reserve_tokens)
            headroom = self.kv.pages_for(len(tokens) + decode_room) - self.kv.pages_for(len(tokens))
            headroom += len(self.table.running)
        # Prompt logprobs need every prompt position computed: no prefix reuse;
        # nor does a pooling request that reads more than its last row.
        reuse = not request.wants_prompt_logprobs and (request.pooling is None or request.pooling.reuses_prefix)
        adapters, adapter = self.table.adapters, request.adapter
        slot = 0
        if adapter is not None and adapters is not None:
            acquired = adapters.acquire(adapter)  # a LoRA slot; None while running requests hold every one
            if acquired is None:
                return False
            slot = acquired
        # KV computed under an adapter is cached under its id alone.
        kv = self.kv.admit(tokens, headroom, use_cache=reuse, namespace=adapter.id if adapter is not None else 0)
        if kv is None:
            if slot:
                adapters.release(slot)  # type: ignore[union-attr]  # set with the slot
            return False
        request.lora_slot = slot
        self.table.start(request, kv)
        return True

    def _end_unadmittable(self, request: Request) -> None:
        """With nothing running, every slot is free and every cached page
        evictable: a request that still does not fit never will. Validation
        bounds requests by the pool, so this is a backstop, not a path."""
        logger.error("request %s (%d tokens) can never fit the KV pool; ending it", request.rid, len(request.all_ids))
        if request.num_output_tokens:
            self.table.finish(request, "length")
        else:
            message = "the request does not fit the KV pool"
            self.table.finish(request, "error", RequestEvent(finish_reason="error", error=message))


def whole_images_end(images: PromptImages, start: int, end: int) -> int:
    """A chunk's end moved so that no image whose tokens attend to each other
    both ways (Gemma 3) is cut: its tokens are computed in one chunk. Before
    such an image the chunk stops short of it; an image the chunk starts in
    (its first tokens cached) is taken whole, past the budget if it must be
    (an image is a few hundred tokens)."""
    for span in images.spans_in(start, end):
        if span.bidirectional and span.offset < end < span.end:
            return span.offset if span.offset > start else span.end
    return end
