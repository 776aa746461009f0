"""Overlap placeholders: how a plan names a token that is not sampled yet.

With overlap scheduling the scheduler plans step N+1 before step N's tokens
are known. In step N+1's plan, the token id `placeholder(r) = -(r + 1)` (in
`input_ids` or in the penalty token lists) means "the token sampled at row r
of step N". Only the step executed immediately before can be named, and only
rows it sampled: the scheduler plans a request with a placeholder only when
its pending token comes from the previous step, and the executing side
(`PreviousStepTokens`) refuses anything else with PlaceholderError rather
than substituting some other row's token.

Both checks read the host copy of the plan, so they cost no device sync.
Like batch_plan, this module imports nothing of the project: a follower rank
resolves placeholders with the same code as rank 0.
"""

from __future__ import annotations

import torch


class PlaceholderError(RuntimeError):
    """A plan names a token the previous step did not sample."""


def placeholder(row: int) -> int:
    """The id that stands for the token sampled at `row` of the previous step."""
    if row < 0:
        raise PlaceholderError(f"no placeholder for row {row}")
    return -(row + 1)


class PreviousStepTokens:
    """The tokens sampled by the last executed step, kept where they were
    computed (on the device), and the substitution of placeholders by them."""

    def __init__(self, device: torch.device) -> None:
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)
        self.step: int | None = None
        self.num_rows = 0

    def record(self, step: int, tokens: torch.Tensor) -> None:
        self.step, self.tokens, self.num_rows = step, tokens, int(tokens.shape[0])

    def check(self, step: int, host_ids: torch.Tensor) -> bool:
        """True if `host_ids` (a CPU tensor of step `step`) holds placeholders;
        PlaceholderError if one names a row the previous step did not sample."""
        if host_ids.numel() == 0:
            return False
        lowest = int(host_ids.min())
        if lowest >= 0:
            return False
        row = -lowest - 1
        if self.step != step - 1:
            raise PlaceholderError(f"step {step} names a token of step {step - 1}, but the last step run was {self.step}")
        if row >= self.num_rows:
            raise PlaceholderError(f"step {step} names row {row} of step {self.step}, which sampled {self.num_rows} rows")
        return True

    def resolve(self, step: int, ids: torch.Tensor, host_ids: torch.Tensor) -> torch.Tensor:
        """`ids` (on the device) with every placeholder replaced by its token."""
        if not self.check(step, host_ids):
            return ids
        rows = torch.where(ids < 0, -ids - 1, 0)  # rows of real tokens are masked below
        return torch.where(ids < 0, self.tokens[rows], ids)
