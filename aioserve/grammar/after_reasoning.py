"""A grammar that lets a thinking model think first: the output is free
until the end-of-reasoning tokens (`</think>`), and the grammar applies to
what follows, as vLLM and SGLang do with a reasoning parser. Without it a
json_schema or a forced tool call would forbid Qwen3's `<think>` from the
first token. The output may still end during the thought (EOS, the length):
then the grammar never began, and the answer is not there.
"""

from __future__ import annotations

from collections import deque

import torch

from aioserve.scheduler.constraint import ConstraintFactory, TokenConstraint


class AfterReasoning:
    """A ConstraintFactory whose constraints start `inner`'s after `end_ids`."""

    def __init__(self, inner: ConstraintFactory, end_ids: list[int]) -> None:
        assert end_ids, "the end of the reasoning must be at least one token"
        self.inner = inner
        self.end_ids = list(end_ids)

    def new_constraint(self, stop_token_ids: list[int]) -> TokenConstraint:
        return _Deferred(self.inner.new_constraint(stop_token_ids), self.end_ids)


# Accepted tokens a _Deferred can roll back: more than any speculative proposal.
MAX_ROLLBACK = 256


class _Deferred:
    def __init__(self, inner: TokenConstraint, end_ids: list[int]) -> None:
        self._inner = inner
        self._end_ids = end_ids
        self._recent: list[int] = []  # the last len(end_ids) tokens of the thought
        self._thinking = True
        # Per accepted token, the state before it and whether `inner` took it.
        self._undo: deque[tuple[bool, list[int], bool]] = deque(maxlen=MAX_ROLLBACK)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._thinking:
            bitmask[row].fill_(-1)  # every bit set: any token
        else:
            self._inner.fill_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        before = (self._thinking, self._recent, not self._thinking)
        if not self._thinking:
            if not self._inner.accept(token_id):
                return False
        else:
            self._recent = (self._recent + [token_id])[-len(self._end_ids) :]
            if self._recent == self._end_ids:
                self._thinking = False
        self._undo.append(before)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._undo):
            raise ValueError(f"cannot roll back {num_tokens} tokens ({len(self._undo)} kept)")
        inner = 0
        for _ in range(num_tokens):
            self._thinking, self._recent, by_inner = self._undo.pop()
            inner += by_inner
        self._inner.rollback(inner)

    def is_terminated(self) -> bool:
        return not self._thinking and self._inner.is_terminated()
