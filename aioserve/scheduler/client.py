"""The scheduler as its clients (HTTP handlers, the offline API, metrics)
see it: a few calls, not the concrete class.

Handlers submit and abort requests, ask whether a request could ever run,
flush the prefix cache and read a snapshot of occupancy and counters. They
never reach into the KV manager, the queues or the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aioserve.scheduler.request import Request
from aioserve.scheduler.speculation import SpeculationStats


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
