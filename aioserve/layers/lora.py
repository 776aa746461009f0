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

* **masked** (a GPU's small steps with several adapters: decodes, and
  every captured graph): one product with the A of every slot, each row's
  other slots zeroed by a one-hot mask, one product with B. Two matmuls
  whatever the mix, nothing that depends on Python branching per row.
* **grouped** (prefill chunks, and a CPU's steps): each used slot's rows
  gathered, multiplied by that slot's A and B only, and added back: a step
  reads the adapters it uses, not every slot. On a CPU with the native
  kernels, every step takes it (one adapter too): one call a projection.

On a CPU with the native kernels built, each slot is also kept as the
native call reads it (A and B as they are, in the stored dtype),
rewritten in place when a slot is loaded:
a torch matmul there woke BLAS's own threads at every call (~150 us for a
16-row update on 2 cores, against ~40 us alone), which made the updates
cost as much as the base model. The native DecoderStack reads the same
slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aioserve.cpu.native import cpu_kernels

# A GPU's steps up to this many tokens take the masked form when they mix
# adapters: its one-hot product costs every slot's rank per row, which beats
# a gather per slot (more kernel launches) while rows are few.
MASKED_MAX_TOKENS = 256


@dataclass
class LoraRouting:
    """One step's rows -> adapter slots, made by the engine from the plan."""

    groups: list[tuple[int, torch.Tensor]]  # (slot, its rows [n] int64) for each slot used, base excluded
    all_rows: int | None = None  # the slot every row of the step uses, when one adapter covers them all
    onehot: torch.Tensor | None = None  # [T, slots]: row t uses slot s (the masked form)
    row_slots: torch.Tensor | None = None  # [T] int64 on a CPU: each row's slot (the native grouped form)


def route_rows(
    token_slots: list[int], num_slots: int, device: torch.device, dtype: torch.dtype
) -> LoraRouting | None:
    """The routing of a step whose row t uses slot token_slots[t] (of
    `num_slots`, the base's included); None when no row uses an adapter
    (the layers then add nothing)."""
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot:
            rows_of.setdefault(slot, []).append(row)
    if not rows_of:
        return None
    row_slots = torch.tensor(token_slots, dtype=torch.long) if device.type == "cpu" else None
    if len(rows_of) == 1:
        ((slot, rows),) = rows_of.items()
        if len(rows) == len(token_slots):
            return LoraRouting([], all_rows=slot, row_slots=row_slots)
    if len(rows_of) > 1 and len(token_slots) <= MASKED_MAX_TOKENS and device.type != "cpu":
        onehot = torch.zeros(len(token_slots), num_slots, dtype=dtype)
        for slot, rows in rows_of.items():
            onehot[rows, slot] = 1
        return LoraRouting([], onehot=onehot.to(device, non_blocking=True))
    groups = [(slot, torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True))
              for slot, rows in sorted(rows_of.items())]
    return LoraRouting(groups, row_slots=row_slots)


@dataclass
class LoraStepState:
    """The current step's routing, shared by every adapted layer of a model;
    set by the engine just before the forward and cleared after it."""

    routing: LoraRouting | None = None


@dataclass
class NativeSlots:
    """The slots as the native call reads them, in the stored dtype: each
    slot's A_s [P * R, in] as it is (native/lora.cpp multiplies by A in dot
    products) and B_s as its parts' blocks one after the other
    (native_gemm.lora_part_blocks: B is block-diagonal, and its zeros are
    neither kept nor read), and their addresses for the library (the
    grouped form's one call, and the DecoderStack)."""

    a: list[torch.Tensor]
    b: list[torch.Tensor]
    pointers: Any = None  # native_gemm.LoraPointers over a and b


@dataclass(eq=False)
class LoraSlots:
    """One layer's adapter slots (see the module docstring)."""

    a: torch.Tensor  # [S, P * R, in]
    b: torch.Tensor  # [S, P * R, out]
    state: LoraStepState
    native: NativeSlots | None = None  # on a CPU with the native kernels
    # What the native copies are stored in: the weights' width (bf16 weights
    # computed in float32 read their adapters as bf16 too: a decode step is
    # bound by the bytes it reads).
    native_dtype: torch.dtype | None = None
    # Each part's first output column, then the width (q|k|v: 0, q, q + kv,
    # out; a layer of one part: 0, out).
    columns: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.columns = self.columns or (0, int(self.b.shape[2]))

    def prepare_native(self, slots: list[int] | None = None) -> bool:
        """Copy every slot for the native kernel the first time; later only
        `slots` (None: all), in place (the native DecoderStack keeps their
        addresses). A load rewrites its own slot, not all of them: 16 loads
        into 17 slots were 272 slot copies a layer. False where there is no
        native kernel (a GPU, no build)."""
        kernels = cpu_kernels(wait=False) if self.a.device.type == "cpu" else None
        if kernels is None:
            return False
        dtype = self.native_dtype or self.a.dtype
        if self.native is None:
            every = range(self.a.shape[0])
            native = NativeSlots([self.a[s].to(dtype, copy=True).contiguous() for s in every],
                                 [kernels.lora_part_blocks(self.b[s], self.columns).to(dtype) for s in every])
            native.pointers = kernels.LoraPointers(native.a, native.b, int(self.a.shape[1]), int(self.a.shape[2]),
                                                 int(self.b.shape[2]), self.columns)
            self.native = native
            return True
        for s in range(self.a.shape[0]) if slots is None else slots:
            self.native.a[s].copy_(self.a[s])
            self.native.b[s].copy_(kernels.lora_part_blocks(self.b[s], self.columns))
        return True

    def _product(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """x A_s^T B_s: slot s's update of rows x."""
        if self.native is not None:  # the native call of mixed rows, added to zeros: one form of the parts' products
            update = torch.zeros(x.shape[0], self.b.shape[2], dtype=x.dtype)
            slots = torch.full((x.shape[0],), slot, dtype=torch.long)
            cpu_kernels(wait=False).lora_add_rows(x, update, slots, self.native.pointers)  # type: ignore[union-attr]
            return update
        return (x @ self.a[slot].T) @ self.b[slot]

    def _masked(self, x: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        """Every row's update through all slots' A, the other slots' columns zeroed."""
        slots, width = self.a.shape[0], self.a.shape[1]
        h = x @ self.a.reshape(slots * width, -1).T
        h = (h.view(-1, slots, width) * onehot.unsqueeze(2)).view(-1, slots * width)
        return h @ self.b.reshape(slots * width, -1)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's low-rank update (y as the layer computed it, before any all-reduce)."""
        routing = self.state.routing
        if routing is None:
            return y
        if x.dtype != self.a.dtype:
            x = x.to(self.a.dtype)
        if self.native is not None and routing.row_slots is not None and x.dtype == y.dtype and y.is_contiguous():
            # One native call, one adapter or many: the slots split among the
            # threads (each slot's rows gathered there), the update added in
            # place (no update tensor of the layer's width to add after).
            cpu_kernels(wait=False).lora_add_rows(x, y, routing.row_slots, self.native.pointers)  # type: ignore[union-attr]
            return y
        if routing.all_rows is not None:
            return y + self._product(x, routing.all_rows).to(y.dtype)
        if routing.onehot is not None:
            return y + self._masked(x, routing.onehot).to(y.dtype)
        for slot, rows in routing.groups:
            y.index_add_(0, rows, self._product(x.index_select(0, rows), slot).to(y.dtype))
        return y
