"""The page table: one row per running request (its *slot*), listing the KV
pages that hold its tokens in order. Kept as a CPU tensor so a batch's rows
are one index_select away."""

from __future__ import annotations

import torch


class PageTable:
    def __init__(self, max_requests: int, max_pages_per_request: int) -> None:
        self.table = torch.zeros((max_requests, max_pages_per_request), dtype=torch.int32)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests
        self.max_pages_per_request = max_pages_per_request

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def free_slot(self, slot: int) -> None:
        self.table[slot].zero_()
        self._free_slots.append(slot)

    def free_slot_ids(self) -> list[int]:
        return list(self._free_slots)

    def write(self, slot: int, start: int, pages: list[int]) -> None:
        if pages:
            self.table[slot, start : start + len(pages)] = torch.tensor(pages, dtype=torch.int32)

    def rows(self, slots: list[int] | torch.Tensor, width: int) -> torch.Tensor:
        """The rows of `slots` (ids, or an int64 tensor of them), `width` pages wide."""
        index = slots if isinstance(slots, torch.Tensor) else torch.tensor(slots, dtype=torch.long)
        return self.table[index, :width]
