"""What the scheduler needs of a grammar: token-level, no text.

Grammars are compiled above the scheduler (they need the tokenizer's
vocabulary: aioserve/grammar/) and reach it as a `ConstraintFactory` on the
request. At submission the scheduler makes the request its own
`TokenConstraint` (a matcher in the grammar's start state, stopping on the
request's stop tokens), fills that matcher's bitmask into each plan that
samples the request, and advances it with every token it accepts.

Under overlap the mask of step N+1 depends on the token of step N, which is
not known when N+1 is planned, so a constrained request is planned only when
it has no token in flight: it sits out every other step, unless at least half
of the decoding requests are constrained, in which case the loop lets the
step in flight land before planning the next (planner.py,
StepPlanner.waits_for_tokens).
"""

from __future__ import annotations

from typing import Protocol

import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a packed token bitmask."""
    return -(-vocab_size // 32)


class TokenConstraint(Protocol):
    """One request's grammar state."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [G, W] CPU bitmask."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token (or needs none)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a speculative proposal
        checked against the grammar, or its positions' masks built)."""
        ...


class ConstraintFactory(Protocol):
    """A compiled grammar: makes a fresh matcher for each request."""

    def new_constraint(self, stop_token_ids: list[int]) -> TokenConstraint:
        """A matcher in the start state; `stop_token_ids` end the output once the
        grammar is complete (none: it ends by itself there)."""
        ...
