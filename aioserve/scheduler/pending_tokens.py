"""A request's sampled-but-unprocessed tokens, and the placeholder that
names the newest of them in the next plan (see aioserve/placeholders.py).

With overlap a request can have up to two tokens in flight: one sampled by
the step being processed and one by the step already launched after it. A
step that verifies a draft samples several rows for the request, and which
of them ends up its newest token is known only once the step is processed:
no placeholder names it (`nameable` False) and nothing plans the request
until it lands.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioserve.placeholders import PlaceholderError, placeholder


@dataclass
class PendingTokens:
    count: int = 0
    step: int = -1  # the step that sampled the newest pending token
    row: int = -1  # its row among that step's samples
    nameable: bool = True  # False while a verified draft is in flight

    def sampled(self, step: int, row: int, nameable: bool = True) -> None:
        self.count += 1
        self.step, self.row, self.nameable = step, row, nameable

    def landed(self) -> None:
        """A step that sampled one of them has been processed."""
        if self.count == 0:
            raise RuntimeError("a token landed that was never pending")
        self.count -= 1

    def reachable_from(self, step: int) -> bool:
        """Whether step `step` can name the newest pending token: only the
        step right after the one that sampled it can, and none names a
        verified draft's."""
        return self.count == 0 or (self.nameable and self.step == step - 1)

    def placeholder_for(self, step: int) -> int | None:
        """The id step `step` uses for the newest pending token; None when
        nothing is pending."""
        if self.count == 0:
            return None
        if not self.reachable_from(step):
            raise PlaceholderError(f"step {step} cannot name a token sampled by step {self.step}")
        return placeholder(self.row)
