"""The scheduler's view of KV memory: free pages, the page table's slots and
the prefix cache, kept consistent with each other.

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
        self.allocator = PageAllocator(num_pages)
        self.table = PageTable(max_requests, max_pages_per_request)
        self.cache = create_prefix_cache(cache, page_size)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_usable_pages(self) -> int:
        return self.allocator.num_usable

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation could get: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.cache.num_evictable_pages

    def match_and_lock(self, tokens: list[int]) -> PrefixMatch:
        match = self.cache.match(tokens)
        self.cache.lock(match)
        return match

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, evicting cached ones when the free list runs short."""
        short = count - self.allocator.num_free
        if short > 0:
            if short > self.cache.num_evictable_pages:
                return None
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(count)

    def release(self, tokens: list[int], pages: list[int], match: PrefixMatch | None, kv_done: int, slot: int) -> None:
        """Give back a request's slot and pages.

        Whole pages whose KV is complete (the first `kv_done` tokens) go to the
        prefix cache; the rest, and copies the cache already had, are freed.
        `pages` starts with the matched prefix's pages, which the cache owns.
        """
        full = min(kv_done // self.page_size, len(pages))
        redundant = self.cache.insert(tokens[: full * self.page_size], pages[:full])
        self.allocator.free(redundant + pages[full:])
        if match is not None:
            self.cache.unlock(match)
        self.table.free_slot(slot)

    def share_computed(
        self, tokens: list[int], pages: list[int], match: PrefixMatch | None, kv_done: int, slot: int
    ) -> tuple[list[int], PrefixMatch | None]:
        """Hand the whole computed pages of a running request to the prefix
        cache, so requests admitted from now on can match them before this
        one finishes (concurrent prompts over one system prompt share it).

        The request keeps reading them through a lock on the new match. Where
        the cache already had a page for the same tokens, the request switches
        to the cache's copy and its own is freed: a step still in flight may
        read it, but only later steps can be handed it. Returns the request's
        new page list and match."""
        full = min(kv_done // self.page_size, len(pages))
        held = len(match.pages) if match is not None else 0
        if not self.cache.reuses or full <= held:
            return pages, match
        redundant = self.cache.insert(tokens[: full * self.page_size], pages[:full])
        # One token past the pages: match never takes a prompt's last token.
        shared = self.cache.match(tokens[: full * self.page_size] + [-1])
        self.cache.lock(shared)
        if match is not None:
            self.cache.unlock(match)
        if redundant:
            self.table.write(slot, 0, shared.pages)
            self.allocator.free(redundant)
        return shared.pages + pages[full:], shared

    def flush(self) -> int:
        pages = self.cache.reset()
        self.allocator.free(pages)
        return len(pages)

    def check_integrity(self, held: list[list[int]], held_slots: list[int]) -> None:
        """Raise AssertionError unless free + cached + held pages cover the
        pool exactly once each, and slots likewise. `held` lists the pages each
        running request owns (not those it borrows from the cache)."""
        where = Counter(self.allocator.free_pages())
        where.update(self.cache.all_pages())
        for pages in held:
            where.update(pages)
        doubled = [page for page, n in where.items() if n > 1]
        expected = set(range(RESERVED_PAGES, self.allocator.num_pages))
        lost = expected - where.keys()
        stray = where.keys() - expected
        assert not doubled and not lost and not stray, (
            f"KV pages out of place: {len(doubled)} in two places, {len(lost)} lost, {len(stray)} unknown"
        )
        slots = Counter(self.table.free_slot_ids() + held_slots)
        assert all(n == 1 for n in slots.values()) and len(slots) == self.table.max_requests, (
            f"page-table slots out of place: {len(slots)} known of {self.table.max_requests}"
        )
        assert self.cache.num_evictable_pages <= self.cache.num_pages
