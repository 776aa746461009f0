"""The scheduler's view of KV memory: free pages, the page table's slots and
the prefix cache, kept consistent with each other.

Each admitted request holds a `RequestKV` (its slot, locked prefix and own
pages); the manager is the only writer of those and of the page table.

Invariant (checked by `check_integrity`): every usable page is in exactly
one place: the free list, the prefix cache, or the own pages of one running
request; and every slot is either free or held by one running request.
"""

from __future__ import annotations

import logging
from collections import Counter

from aioserve.kvcache.kv_pool import RESERVED_PAGES
from aioserve.kvcache.page_allocator import PageAllocator
from aioserve.kvcache.page_table import PageTable
from aioserve.kvcache.prefix_cache import NaiveCache, PrefixCache, PrefixMatch
from aioserve.kvcache.radix_cache import RadixCache
from aioserve.kvcache.request_kv import RequestKV

logger = logging.getLogger(__name__)


def create_prefix_cache(kind: str, page_size: int) -> PrefixCache:
    if kind == "radix":
        return RadixCache(page_size)
    if kind == "naive":
        return NaiveCache(page_size)
    raise ValueError(f"unknown cache {kind!r} (radix, naive)")


class KVManager:
    def __init__(self, num_pages: int, page_size: int, max_requests: int, max_pages_per_request: int, cache: str) -> None:
        self.page_size = page_size
        self._shape = (num_pages, max_requests, max_pages_per_request, cache)
        self.reset()

    def reset(self) -> None:
        """Every page free, every slot free, no cached prefix: a fresh state in
        this same object (the scheduler's parts all hold it)."""
        num_pages, max_requests, max_pages_per_request, cache = self._shape
        self.allocator = PageAllocator(num_pages)
        self.table = PageTable(max_requests, max_pages_per_request)
        self.cache = create_prefix_cache(cache, self.page_size)

    @property
    def num_usable_pages(self) -> int:
        return self.allocator.num_usable

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation could get: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.cache.num_evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, evicting cached ones when the free list runs short."""
        short = count - self.allocator.num_free
        if short > 0:
            if short > self.cache.num_evictable_pages:
                return None
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(count)

    # -- a request's KV: admit, extend, share, release --------------------------

    def admit(
        self, tokens: list[int], headroom_pages: int = 0, use_cache: bool = True, namespace: int = 0
    ) -> RequestKV | None:
        """A slot and pages for all of `tokens`, reusing the longest cached
        prefix of its `namespace` (its LoRA adapter), if the pool can give
        them and still keep `headroom_pages` available; None (and nothing
        held) otherwise."""
        if self.table.num_free_slots == 0:
            return None
        match = self.cache.match(tokens, namespace) if use_cache else PrefixMatch([], 0)
        self.cache.lock(match)
        need = self.pages_for(len(tokens)) - len(match.pages)
        pages = self.allocate(need) if self.num_available_pages >= need + headroom_pages else None
        if pages is None:
            self.cache.unlock(match)
            return None
        slot = self.table.alloc_slot()
        assert slot is not None
        kv = RequestKV(slot, match, pages, kv_len=match.num_tokens, kv_done=match.num_tokens, namespace=namespace)
        self.table.write(slot, 0, kv.pages)
        return kv

    def pages_short(self, kv: RequestKV, num_tokens: int) -> int:
        """New pages `kv` needs to hold `num_tokens` tokens."""
        return max(0, self.pages_for(num_tokens) - kv.num_pages)

    def extend(self, kv: RequestKV, num_tokens: int) -> bool:
        """Grow `kv` to hold `num_tokens` tokens; False (nothing changed) if
        the pool cannot."""
        short = self.pages_short(kv, num_tokens)
        if short == 0:
            return True
        if len(kv.pages) + short > self.table.max_pages_per_request:
            raise ValueError(f"{num_tokens} tokens exceed the page table's row")
        pages = self.allocate(short)
        if pages is None:
            return False
        self.table.write(kv.slot, kv.num_pages, pages)
        kv.own_pages += pages
        return True

    def truncate(self, kv: RequestKV, num_tokens: int) -> None:
        """Shrink `kv` to its first `num_tokens` tokens (a verified draft whose
        tail was rejected): the KV past them is garbage and the pages that
        held only such KV go back to the pool at once. Only the request's own
        pages can go: a cached prefix page holds accepted tokens."""
        kv.check_live()
        if num_tokens > kv.kv_len:
            raise ValueError(f"cannot truncate KV of {kv.kv_len} tokens to {num_tokens}")
        keep = max(self.pages_for(num_tokens) - len(kv.prefix.pages), 0)
        if keep < len(kv.own_pages):
            self.allocator.free(kv.own_pages[keep:])
            kv.own_pages = kv.own_pages[:keep]
        kv.kv_len = num_tokens
        kv.kv_done = min(kv.kv_done, num_tokens)

    def share_computed(self, kv: RequestKV, tokens: list[int]) -> None:
        """Hand the whole computed pages of a running request to the prefix
        cache, so requests admitted from now on can match them before this
        one finishes (concurrent prompts over one system prompt share it).

        The request keeps reading them through a lock on the new match. Where
        the cache already had a page for the same tokens, the request switches
        to the cache's copy and its own is freed: a step still in flight may
        read it, but only later steps can be handed it."""
        pages = kv.pages
        full = min(kv.kv_done // self.page_size, len(pages))
        if not self.cache.reuses or full <= len(kv.prefix.pages):
            return
        redundant = self.cache.insert(tokens[: full * self.page_size], pages[:full], kv.namespace)
        # One token past the pages: match never takes a prompt's last token.
        shared = self.cache.match(tokens[: full * self.page_size] + [-1], kv.namespace)
        self.cache.lock(shared)
        self.cache.unlock(kv.prefix)
        if redundant:
            self.table.write(kv.slot, 0, shared.pages)
            self.allocator.free(redundant)
        kv.prefix, kv.own_pages = shared, pages[full:]

    def release(self, kv: RequestKV, tokens: list[int]) -> None:
        """Give back a request's slot and pages (it finished, was aborted or
        is preempted: the same thing to the pool).

        Whole pages whose KV is complete (the first `kv_done` tokens) go to the
        prefix cache, so a preempted request often finds most of them again;
        the rest, and copies the cache already had, are freed."""
        kv.check_live()
        pages = kv.pages
        full = min(kv.kv_done // self.page_size, len(pages))
        redundant = self.cache.insert(tokens[: full * self.page_size], pages[:full], kv.namespace)
        self.allocator.free(redundant + pages[full:])
        self.cache.unlock(kv.prefix)
        self.table.free_slot(kv.slot)
        kv.released = True
        kv.own_pages = []

    def flush(self) -> int:
        pages = self.cache.reset()
        self.allocator.free(pages)
        return len(pages)

    def check_integrity(self, held: list[RequestKV]) -> None:
        """Raise AssertionError unless free + cached + held pages cover the
        pool exactly once each, and slots likewise; `held` is the KV of every
        running request. Its own pages count, not those it borrows from the
        cache."""
        where = Counter(self.allocator.free_pages())
        where.update(self.cache.all_pages())
        for kv in held:
            assert not kv.released, f"released KV of slot {kv.slot} still held"
            where.update(kv.own_pages)
        doubled = [page for page, n in where.items() if n > 1]
        expected = set(range(RESERVED_PAGES, self.allocator.num_pages))
        lost = expected - where.keys()
        stray = where.keys() - expected
        assert not doubled and not lost and not stray, (
            f"KV pages out of place: {len(doubled)} in two places, {len(lost)} lost, {len(stray)} unknown"
        )
        slots = Counter(self.table.free_slot_ids() + [kv.slot for kv in held])
        assert all(n == 1 for n in slots.values()) and len(slots) == self.table.max_requests, (
            f"page-table slots out of place: {len(slots)} known of {self.table.max_requests}"
        )
        assert self.cache.num_evictable_pages <= self.cache.num_pages
