"""Low-rank adapters on a linear layer, many at once in one batch.

A layer's adapters live in slots: `a` is [slots, parts * rank, in] and `b`
[slots, parts * rank, out] (B transposed, its scale alpha / r folded in),
so each row of the step adds `(x A_s^T) B_s` for the slot s of its request.
Slot 0 is the base model and stays zero. A fused layer (q/k/v, gate/up)
holds each part's adapter in its own band of rank rows: A's bands stacked,
B's block-diagonal, so an adapter of `q_proj` alone is zero elsewhere.

Which row reads which slot changes every step; the engine hands it to every
adapted layer through one `LoraStepState` the model's layers share (no
global: each engine makes its own). Two forms compute the same sum:

* **masked** (small steps, several adapters: decodes): one product with the
  A of every slot up to the highest used, each row's other slots zeroed by
  a one-hot mask, one product with B. Two matmuls whatever the mix, with
  nothing that depends on Python branching per row.
* **grouped** (prefill chunks): each slot's rows gathered, multiplied by
  that slot's A and B only, and added back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Steps up to this many tokens take the masked form when they mix adapters:
# its one-hot product costs every used slot's rank per row, which beats a
# gather per slot while rows are few.
MASKED_MAX_TOKENS = 256


@dataclass
class LoraRouting:
    """One step's rows -> adapter slots, made by the engine from the plan."""

    groups: list[tuple[int, torch.Tensor]]  # (slot, its rows [n] int64) for each slot used, base excluded
    all_rows: int | None = None  # the slot every row of the step uses, when one adapter covers them all
    onehot: torch.Tensor | None = None  # [T, k]: row t uses slot j + 1 (the masked form), k = highest slot used

    @property
    def num_slots(self) -> int:
        return 0 if self.onehot is None else int(self.onehot.shape[1])


def route_rows(token_slots: list[int], device: torch.device, dtype: torch.dtype) -> LoraRouting | None:
    """The routing of a step whose row t uses slot token_slots[t]; None when
    no row uses an adapter (the layers then add nothing)."""
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot:
            rows_of.setdefault(slot, []).append(row)
    if not rows_of:
        return None
    if len(rows_of) == 1:
        ((slot, rows),) = rows_of.items()
        if len(rows) == len(token_slots):
            return LoraRouting([], all_rows=slot)
    if len(rows_of) > 1 and len(token_slots) <= MASKED_MAX_TOKENS:
        k = max(rows_of)
        onehot = torch.zeros(len(token_slots), k, dtype=dtype)
        for slot, rows in rows_of.items():
            onehot[rows, slot - 1] = 1
        return LoraRouting([], onehot=onehot.to(device, non_blocking=True))
    groups = [(slot, torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True))
              for slot, rows in sorted(rows_of.items())]
    return LoraRouting(groups)


@dataclass
class LoraStepState:
    """The current step's routing, shared by every adapted layer of a model;
    set by the engine just before the forward and cleared after it."""

    routing: LoraRouting | None = None


@dataclass(eq=False)
class LoraSlots:
    """One layer's adapter slots (see the module docstring)."""

    a: torch.Tensor  # [S, P * R, in]
    b: torch.Tensor  # [S, P * R, out]
    state: LoraStepState
    part_rows: list[tuple[int, int]] = field(default_factory=list)  # each part's (first output row, rows) here

    @property
    def band(self) -> int:
        """Rank rows per part (the slots' rank)."""
        return int(self.a.shape[1]) // max(len(self.part_rows), 1)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's low-rank update (y as the layer computed it, before any all-reduce)."""
        routing = self.state.routing
        if routing is None:
            return y
        if x.dtype != self.a.dtype:
            x = x.to(self.a.dtype)
        if routing.all_rows is not None:
            slot = routing.all_rows
            return y + ((x @ self.a[slot].T) @ self.b[slot]).to(y.dtype)
        if routing.onehot is not None:
            k, width = routing.num_slots, self.a.shape[1]
            h = x @ self.a[1 : k + 1].reshape(k * width, -1).T  # [T, k * width]: every used slot's A
            h = (h.view(-1, k, width) * routing.onehot.unsqueeze(2)).view(-1, k * width)
            return y + (h @ self.b[1 : k + 1].reshape(k * width, -1)).to(y.dtype)
        for slot, rows in routing.groups:
            update = (x.index_select(0, rows) @ self.a[slot].T) @ self.b[slot]
            y.index_add_(0, rows, update.to(y.dtype))
        return y
