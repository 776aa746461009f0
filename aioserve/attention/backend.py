"""The attention backend interface.

A backend turns a batch plan into metadata once per step (`prepare`); every
layer then calls `metadata.attend`, which stores the step's new keys and
values into the pool and attends over each request's cached prefix plus its
new tokens. The model hands the metadata down as an argument: no layer
reaches up for a global "current batch".
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from aioserve.batch_plan import BatchPlan


class AttentionMetadata(ABC):
    @abstractmethod
    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, plan: BatchPlan, host_plan: BatchPlan) -> AttentionMetadata:
        """Per-step work shared by all layers (index tensors, masks, plans).
        `plan` is on the engine's device; `host_plan` is the same plan on the
        CPU, for lengths the backend must know without a device sync."""
