"""Speculative decoding in the scheduler: which decoding requests verify
drafts this step, and how many of a verified draft's tokens stand.

A speculating request's entry is an extend of k + 1 tokens, its newest
token and k proposed ones, each position sampled as a decode would sample
it (the same parameters, penalties counting the proposed tokens before it,
the same seeded draw for the same output index). Proposals are single
sequences (top-1), so a proposal's distribution is a point mass and the
speculative-sampling rule (accept d with probability min(1, p(d)/q(d)),
else sample the residual) reduces to: keep d while the target's own sample
at its position is d; the first position where they differ gives the
target's token instead. Every token emitted is therefore the token the
target samples at that position, seeded draws included: the output is the
one plain decoding gives. Under a grammar, a proposal is cut where the
matcher refuses it, and position i's mask is the matcher's after the i
proposed tokens before it (advanced, read, rolled back).

A verified request's next token depends on how many drafts stood, which no
placeholder can name, so it is planned again only once its step has been
processed (the loop waits for it when most decoders speculate; see
planner.py's `waits_for_tokens`). Above `disable_by_batch_size` decoding
requests a step verifies nothing and plain decoding (with overlap) runs.

A verification costs more than a decode (k + 1 rows, and no overlap), so a
request whose proposals keep failing backs off: after m chances in a row
that kept no proposed token (a verification that kept none, or a prompt
lookup that found nothing) it skips the next 2**m - 1 chances to propose
(at most MAX_BACKOFF_STEPS, or MAX_EMPTY_BACKOFF_STEPS after a lookup that
found nothing), and any kept token resets it. A chance passes at every
step the request decodes in, its token landed or not, so while every
speculating request backs off the loop keeps overlap (planner.py's
`waits_for_tokens` asks `would_propose`): on an H200 a step that waits for
its predecessor's tokens cost Qwen3-0.6B 30% at batch 1 (422 -> 299
tok/s), the whole cost of proposals that always fail before this rule.

Two proposers: prompt lookup (ngram_proposer.py), which names its tokens
here, and a model in the engine (draft_model_proposer.py: a draft model or
an EAGLE-3 head), which only reserves their rows: the engine fills them
within the step, and the step's output returns them to the output
processor, which accepts as for ngram.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

from aioserve.kvcache.manager import KVManager
from aioserve.scheduler.constraint import TokenConstraint
from aioserve.scheduler.request import Request
from aioserve.scheduler.draft_model_proposer import DraftModelProposer
from aioserve.scheduler.ngram_proposer import NgramProposer
from aioserve.speculative_config import SpeculativeConfig


@dataclass
class SpeculationStats:
    """vLLM's spec-decode counters (its names under aioserve's prefix)."""

    drafts: int = 0  # verifications: one per request per step that verified a draft
    draft_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # proposed tokens that stood
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i stood

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step gives on average (SGLang's avg_spec_accept_length); 0 before any."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0  # the accepted, and the target's own

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


MAX_BACKOFF_STEPS = 15
# A lookup that found nothing cost only the overlap it waited for, and text
# that quotes itself often starts to a few tokens on: it passes up fewer chances.
MAX_EMPTY_BACKOFF_STEPS = 3


@dataclass
class _Backoff:
    misses: int = 0  # verifications in a row that kept no proposed token
    skip: int = 0  # chances to propose still to pass up


class Proposer(Protocol):
    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """At most `num_tokens` tokens to follow `request.all_ids`."""
        ...


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # draft_model, eagle3: the plan reserves the proposals' rows, the
        # engine's draft fills them within the step.
        self.proposes_in_engine = config.method in ("draft_model", "eagle3")
        # eagle3: the head reads each row's next token (BatchPlan.following_ids).
        self.follows_target = config.method == "eagle3"
        self.proposer: Proposer = (
            DraftModelProposer() if self.proposes_in_engine else NgramProposer(config.lookup_max, config.lookup_min)
        )
        self.stats = SpeculationStats()
        self._backoff: weakref.WeakKeyDictionary[Request, _Backoff] = weakref.WeakKeyDictionary()

    def verified(self, request: Request, proposed: int, accepted: int) -> None:
        """A verification of `request`'s proposal was processed: the counters
        (the server's and the request's own) and the request's backoff."""
        self.stats.record(proposed, accepted)
        if request.speculation is not None:
            request.speculation.steps += 1
            request.speculation.proposed += proposed
            request.speculation.accepted += accepted
        self._chance_taken(request, kept_a_token=accepted > 0, most_skipped=MAX_BACKOFF_STEPS)

    def _chance_taken(self, request: Request, kept_a_token: bool, most_skipped: int) -> None:
        backoff = self._backoff.setdefault(request, _Backoff())
        if kept_a_token:
            backoff.misses = backoff.skip = 0
        else:
            backoff.misses += 1
            backoff.skip = min(2**backoff.misses - 1, most_skipped)

    def would_propose(self, request: Request) -> bool:
        """Whether the next step's plan would ask `request` for a proposal
        (it is not backing off): only then is its token worth waiting for."""
        backoff = self._backoff.get(request)
        return backoff is None or not backoff.skip

    def _backs_off(self, request: Request) -> bool:
        """Whether `request` passes up this step's chance (one fewer to pass up)."""
        if self.would_propose(request):
            return False
        self._backoff[request].skip -= 1
        return True

    def active_for(self, num_decoding: int) -> bool:
        """Whether a step with this many decoding requests verifies drafts."""
        return 0 < num_decoding <= self.config.disable_by_batch_size

    @staticmethod
    def grammatical(constraint: TokenConstraint, draft: list[int]) -> list[int]:
        """The longest start of `draft` the grammar allows (nothing past its
        end); the matcher is left as it was."""
        kept = 0
        for token in draft:
            if constraint.is_terminated() or not constraint.accept(token):
                break
            kept += 1
        constraint.rollback(kept)
        return draft[:kept]

    def drafts(self, decoders: list[Request], kv: KVManager) -> dict[Request, list[int]]:
        """The proposal each decoder verifies this step (those without one
        decode plainly). A request proposes no more tokens than it may still
        generate after the target's own, and only as many as the pool holds
        pages for right now: a draft never preempts anyone."""
        if not self.active_for(len(decoders)):
            return {}
        chosen: dict[Request, list[int]] = {}
        for request in decoders:
            if self._backs_off(request) or request.pending.count:  # proposals need the newest token landed
                continue
            room = request.max_new_tokens - request.num_generated - 1
            draft = self.proposer.propose(request, min(self.config.num_tokens, room))
            if room > 0 and not draft and not self.proposes_in_engine:
                self._chance_taken(request, kept_a_token=False, most_skipped=MAX_EMPTY_BACKOFF_STEPS)
            if draft and request.constraint is not None:
                draft = self.grammatical(request.constraint, draft)
            if draft and kv.extend(request.admitted_kv, request.kv_len + 1 + len(draft)):
                chosen[request] = draft
        return chosen
