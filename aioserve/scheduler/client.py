"""The scheduler as its clients (HTTP handlers, the offline API, metrics)
see it: a few calls, not the concrete class.

Handlers submit and abort requests, ask whether a request could ever run,
flush the prefix cache and read a snapshot of occupancy and counters. They
never reach into the KV manager, the queues or the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aioserve.scheduler.adapters import Adapter
from aioserve.scheduler.request import Request
from aioserve.scheduler.speculation import SpeculationStats


@dataclass
class LoraInfo:
    """LoRA serving's state: adapters by name, requests under each, slots."""

    max_loras: int
    max_lora_rank: int  # the slots' rank (--max-lora-rank)
    max_cpu_loras: int | None  # adapters kept read in host memory (None: all)
    adapters: dict[str, str]  # name -> folder, of the loaded ones
    running: dict[str, int]  # adapter name -> running requests under it
    waiting: dict[str, int]
    slots_in_use: int
    evictions: int  # adapters that left a slot for another


@dataclass
class SchedulerInfo:
    """A snapshot for /server_info and /metrics."""

    running: int
    waiting: int
    page_size: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_cached: int
    kv_pages_evictable: int
    kv_integrity: str  # "ok", what the integrity check found, or "not checked"
    max_prefill_tokens: int
    stats: dict[str, int] = field(default_factory=dict)
    speculation: SpeculationStats | None = None  # with speculative decoding on: its counters
    avg_spec_accept_length: float | None = None  # SGLang's name: tokens a verification gives, on average
    lora: LoraInfo | None = None  # with LoRA served: its adapters and slots

    @property
    def kv_usage(self) -> float:
        """Share of usable pages held by requests (free and evictable ones are not)."""
        used = self.kv_pages_total - self.kv_pages_free - self.kv_pages_evictable
        return used / self.kv_pages_total if self.kv_pages_total else 0.0


class SchedulerClient(Protocol):
    def validate(self, prompt_len: int, max_tokens: int | None) -> int:
        """How many tokens a request may generate; RequestRejected if it can never run."""
        ...

    def submit(self, request: Request) -> None:
        """Queue a request; its sink gets its events. RequestRejected if it can never run."""
        ...

    def submit_all(self, requests: list[Request]) -> None:
        """Check every request (sampling parameters, token ids, context and pool),
        then queue them all; a ValueError naming the field leaves nothing queued."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (what --max-waiting-requests bounds)."""
        ...

    def abort(self, rid: str, reason: str = "abort") -> bool:
        """End a request now (its sink gets a last event); False if unknown."""
        ...

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False while requests run."""
        ...

    def info(self, check_integrity: bool = False) -> SchedulerInfo:
        """Occupancy and counters; with check_integrity, also the KV bookkeeping check (O(pages))."""
        ...

    @property
    def serves_adapters(self) -> bool:
        """Whether LoRA adapters are served (--enable-lora)."""
        ...

    def adapter(self, name: str) -> Adapter | None:
        """The loaded LoRA adapter of that name, if any."""
        ...

    async def load_adapter(self, name: str, path: str) -> Adapter:
        """Read and check an adapter off the loop, then serve it under `name`
        (AdapterError: not servable, or the name is taken)."""
        ...

    def unload_adapter(self, name: str) -> bool:
        """Stop serving an adapter (False: none of that name); its running requests finish on it."""
        ...
