"""Processing a step's output, entry by entry, in named phases:

1. `_settle`: the entry's pending token has landed; if the request still
   holds the admission the entry was planned for, its KV up to the entry is
   now computed, and computed prompt pages go to the prefix cache.
2. `_record_prompt_logprobs`, for requests that asked for them.
3. `_accept`: append the sampled token and its logprobs;
   `_advance_grammar`: a constrained request's matcher takes the token.
4. `_stop_reason`: stop token, EOS, a completed grammar, or the token limit.
5. `_event`: what the consumer hears (the first event also carries the
   prompt's metadata); then finish the request or just deliver.

A verified draft (speculation.py) goes through the same phases once per
token it gives (a draft model's proposal is read from the step's output
first: it was made within the step): its tokens up to the first the target did not propose,
which is the target's own; the KV of the rest is dropped (its pages freed)
before anything is delivered.

Entries of requests that ended meanwhile (aborted, stop string) only
settle their pending count. A row the sampler could not sample (logits not
finite, or no token left by its parameters; marked with a NaN logprob) ends
its request with an error before anything else: the KV that step wrote for
it may be broken too, so it is neither counted as computed nor shared with
the prefix cache.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from aioserve.batch_plan import StepOutput
from aioserve.scheduler.plan_builder import ScheduledStep, StepEntry
from aioserve.scheduler.request import Request, RequestEvent, Status
from aioserve.scheduler.request_table import RequestTable
from aioserve.scheduler.speculation import Speculator

logger = logging.getLogger(__name__)

TopLogprobs = list[tuple[int, float]]


@dataclass
class _HostOutput:
    """A step's sampled rows as Python lists, converted once per step."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    draft_tokens: list[int]  # a draft model's proposals (StepOutput.draft_tokens)

    @classmethod
    def of(cls, output: StepOutput) -> "_HostOutput":
        return cls(
            output.next_token_ids.tolist(),
            output.logprobs.tolist(),
            output.top_ids.tolist() if output.top_ids is not None else None,
            output.top_logprobs.tolist() if output.top_logprobs is not None else None,
            output.draft_tokens.tolist() if output.draft_tokens is not None else [],
        )

    def sampled(self, row: int) -> bool:
        """False where the sampler could not sample the row (engine/sampler.py)."""
        return not math.isnan(self.logprobs[row])

    def top(self, row: int, wanted: int | None) -> TopLogprobs | None:
        if not wanted or self.top_ids is None or self.top_logprobs is None:
            return None
        return list(zip(self.top_ids[row][:wanted], self.top_logprobs[row][:wanted]))


class OutputProcessor:
    def __init__(
        self, table: RequestTable, eos_token_ids: list[int], speculator: Speculator | None = None
    ) -> None:
        self.table = table
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculator = speculator

    def process(self, step: ScheduledStep, output: StepOutput) -> None:
        host = _HostOutput.of(output)
        for entry in step.entries:
            request = entry.request
            if entry.row is not None:
                request.pending.landed()
            if request.finished:
                continue
            if entry.draft:
                self._process_verified(request, entry, host)
                continue
            if entry.row is not None and not host.sampled(entry.row):
                self._fail_unsampled(request)
                continue
            current = self._settle(request, entry)
            if entry.prompt_logprob_span is not None:
                self._record_prompt_logprobs(request, entry, output)
            if entry.pool_segment is not None and current:
                self._record_pooled(request, entry, output)
            if entry.row is None:
                if current and request.max_new_tokens == 0 and entry.kv_len_after == request.num_prompt_tokens:
                    self._finish_prompt_only(request)
                continue
            if request.speculation is not None:
                request.speculation.steps += 1
            token = self._accept(request, entry.row, host)
            if not self._advance_grammar(request, token):
                continue
            reason = self._stop_reason(request, token)
            event = self._event(request, entry.row, token, reason, host)
            if reason is not None:
                self.table.finish(request, reason, event)
            else:
                self.table.deliver(request, event)

    def _process_verified(self, request: Request, entry: StepEntry, host: _HostOutput) -> None:
        """A verified draft: the target's tokens at its positions, up to and
        including the first that differs from the proposal."""
        assert entry.row is not None
        proposed = len(entry.draft)
        if entry.draft_offset is not None:  # the engine's draft model proposed them within the step
            entry.draft = host.draft_tokens[entry.draft_offset : entry.draft_offset + proposed]
        tokens: list[int] = []
        for i in range(proposed + 1):
            if not host.sampled(entry.row + i):
                self._fail_unsampled(request)
                return
            tokens.append(host.tokens[entry.row + i])
            if i == proposed or tokens[-1] != entry.draft[i]:
                break
        if self.speculator is not None:
            self.speculator.verified(request, proposed, len(tokens) - 1)
        events: list[tuple[RequestEvent, str | None]] = []
        for i, token in enumerate(tokens):
            self._accept(request, entry.row + i, host)
            if not self._advance_grammar(request, token):
                return
            reason = self._stop_reason(request, token)
            events.append((self._event(request, entry.row + i, token, reason, host), reason))
            if reason is not None:
                break
        if request.status is Status.RUNNING and request.kv is entry.kv:
            # KV stands for the positions of the tokens kept (the newest
            # token's and the accepted proposals'); the pages that held only
            # rejected or unneeded positions go back now.
            valid = entry.first_position + len(events)
            self.table.kv.truncate(request.kv, valid)
            request.kv.computed(valid)
        for event, reason in events:
            if request.finished:  # its consumer failed and ended it
                return
            if reason is not None:
                self.table.finish(request, reason, event)
            else:
                self.table.deliver(request, event)

    # -- the phases ----------------------------------------------------------------

    def _fail_unsampled(self, request: Request) -> None:
        logger.error("request %s: nothing to sample (non-finite logits, or no token left); ending it", request.rid)
        message = (
            "sampling failed: the model's logits were not finite, or the sampling parameters "
            "(penalties, logit_bias, a grammar) left no token to choose"
        )
        self.table.finish(request, "error", RequestEvent(finish_reason="error", error=message))

    def _settle(self, request: Request, entry: StepEntry) -> bool:
        """Record computed KV; False when the entry belongs to an earlier
        admission (the request was preempted since: it recomputes)."""
        if request.status is not Status.RUNNING or request.kv is not entry.kv:
            return False
        request.kv.computed(entry.kv_len_after)
        if entry.prefill:
            self.table.kv.share_computed(request.kv, request.cache_ids)
        return True

    @staticmethod
    def _record_prompt_logprobs(request: Request, entry: StepEntry, output: StepOutput) -> None:
        assert entry.prompt_logprob_span is not None and output.prompt_logprobs is not None
        first, count = entry.prompt_logprob_span
        wanted = request.params.prompt_logprobs or 0
        # Each tensor's rows taken to Python at once: indexing them token by
        # token cost ~50 µs a token on the event loop (0.2 s a step at n=6
        # of a 4k-token prompt echoed with logprobs).
        rows = slice(first, first + count)
        logprobs = output.prompt_logprobs[rows].tolist()
        tops: list[TopLogprobs] = [[] for _ in range(count)]
        if output.prompt_top_ids is not None and output.prompt_top_logprobs is not None:
            top_ids = output.prompt_top_ids[rows, :wanted].tolist()
            top_lps = output.prompt_top_logprobs[rows, :wanted].tolist()
            tops = [list(zip(ids, lps)) for ids, lps in zip(top_ids, top_lps)]
        ranks = output.prompt_ranks[rows].tolist() if output.prompt_ranks is not None else None
        for i in range(count):
            # Position p's logits give the logprob of prompt token p + 1; a
            # recomputed chunk (after preemption) may repeat positions already had.
            if entry.first_position + i + 1 != len(request.prompt_logprobs):
                continue
            request.prompt_logprobs.append((float(logprobs[i]), tops[i]))
            if ranks is not None:
                request.prompt_logprob_ranks.append(int(ranks[i]))

    def _accept(self, request: Request, row: int, host: _HostOutput) -> int:
        token = host.tokens[row]
        request.all_ids.append(token)
        request.output_logprobs.append(host.logprobs[row])
        self.table.stats.generated_tokens += 1
        return token

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Feed the token to the request's grammar. The mask allowed only
        tokens it accepts, so a refusal is a bug: it ends the request with an
        error rather than letting it emit text the grammar does not match."""
        if request.constraint is None or request.constraint.accept(token):
            return True
        logger.error("request %s: the grammar refused token %d it had allowed", request.rid, token)
        message = "the sampled token does not match the request's grammar"
        self.table.finish(request, "error", RequestEvent(finish_reason="error", error=message))
        return False

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if request.constraint is not None and request.constraint.is_terminated():
            return "stop"  # the grammar is complete and needs no stop token
        if request.num_output_tokens >= request.max_new_tokens:
            return "length"
        return None

    def _event(self, request: Request, row: int, token: int, reason: str | None, host: _HostOutput) -> RequestEvent:
        event = RequestEvent(
            token_id=token,
            logprob=host.logprobs[row],
            top_logprobs=host.top(row, request.params.logprobs),
            finish_reason=reason,
            speculation=dataclasses.replace(request.speculation) if request.speculation is not None else None,
        )
        self._add_first_event_metadata(request, event)
        return event

    @staticmethod
    def _add_first_event_metadata(request: Request, event: RequestEvent) -> None:
        if request.first_event_sent:
            return
        request.first_event_sent = True
        event.num_prompt_tokens = request.num_prompt_tokens
        event.num_cached_tokens = request.num_cached_tokens
        if request.params.prompt_logprobs is not None:
            event.prompt_logprobs = request.prompt_logprobs
            event.prompt_logprob_ranks = request.prompt_logprob_ranks

    @staticmethod
    def _record_pooled(request: Request, entry: StepEntry, output: StepOutput) -> None:
        assert request.pooling is not None and entry.pool_segment is not None and output.pooled is not None
        segment = entry.pool_segment
        scores = output.scores[segment] if output.scores is not None else None
        rows = entry.kv_len_after - entry.first_position
        request.pooling.add(output.pooled[segment], scores, rows, first=entry.first_position == 0,
                            last=entry.kv_len_after == request.num_prompt_tokens)

    def _finish_prompt_only(self, request: Request) -> None:
        """max_tokens 0: the prompt is computed (and scored, or pooled), nothing is generated."""
        event = RequestEvent(finish_reason="length", pooled=request.pooling.result() if request.pooling else None)
        self._add_first_event_metadata(request, event)
        self.table.finish(request, "length", event)
