"""A compiled grammar and its per-request matchers: what the scheduler sees
as a ConstraintFactory and its TokenConstraints (scheduler/constraint.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where used: ~1 s, and only a constrained request needs it (see compiler.py)
    import xgrammar as xgr


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        # Without stop tokens (ignore_eos and no stop_token_ids) the output
        # ends as soon as the grammar is complete.
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=stop_token_ids or None,
            terminate_without_stop_token=not stop_token_ids,
        )

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class CompiledGrammar:
    """A grammar compiled for one vocabulary; shared by every request that asks
    for the same constraint (each gets its own matcher)."""

    def __init__(self, compiled: xgr.CompiledGrammar, kind: str) -> None:
        self.compiled = compiled
        self.kind = kind  # json | json_object | regex | choice | grammar

    def new_constraint(self, stop_token_ids: list[int]) -> GrammarMatcher:
        return GrammarMatcher(self.compiled, stop_token_ids)

    def allows_a_first_token(self, vocab_size: int) -> bool:
        """Whether any token may start the output (EOS counts: the empty text)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        xgr.GrammarMatcher(self.compiled).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())
