"""The draft_model method's side of planning: how many tokens a request's
verification holds room for, not which tokens (those come from the draft
model inside the engine's step, after the plan is built; see
engine/draft_runner.py and batch_plan.DraftBatch).

A verified row is sampled exactly as a plain decode would be only if its
sampling settings do not depend on the proposed tokens before it. Penalties
count those tokens and a grammar's mask is the matcher's after them; with
the tokens unknown when the plan is built, such requests decode plainly in
this version. logit_bias and min_tokens depend only on the output index,
so they speculate.
"""

from __future__ import annotations

from aioserve.scheduler.request import Request

# What a proposal's rows hold in the plan until the engine writes the draft's
# tokens there (any valid id: it is never read before being overwritten).
DRAFT_PLACEHOLDER = 0


class DraftModelProposer:
    """Proposes `num_tokens` placeholders for every request whose rows can be
    verified without knowing the proposals; nothing for the others."""

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        if num_tokens <= 0 or not self.speculates(request):
            return []
        return [DRAFT_PLACEHOLDER] * num_tokens

    @staticmethod
    def speculates(request: Request) -> bool:
        """Whether the request's sampling is independent of the proposals."""
        return request.constraint is None and not request.params.has_penalties
