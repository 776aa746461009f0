"""Radix cache, allocator and the page bookkeeping invariant."""

from __future__ import annotations

import pytest

from aioserve.kvcache.manager import KVManager
from aioserve.kvcache.radix_cache import RadixCache


def test_match_never_includes_the_last_token_and_counts_whole_pages() -> None:
    cache = RadixCache(page_size=4)
    tokens = list(range(12))
    assert cache.insert(tokens, [7, 8, 9]) == []
    match = cache.match(tokens)  # 11 matchable tokens: 2 whole pages
    assert (match.pages, match.num_tokens) == ([7, 8], 8)
    longer = cache.match(tokens + [99])
    assert (longer.pages, longer.num_tokens) == ([7, 8, 9], 12)
    assert cache.match([0, 1, 2, 5, 6]).num_tokens == 0  # differs inside the first page


def test_insert_splits_and_returns_duplicates() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    # Shares the first page, then diverges: the shared page is a duplicate.
    redundant = cache.insert([1, 2, 9, 9], [20, 21])
    assert redundant == [20]
    assert sorted(cache.all_pages()) == [10, 11, 12, 21]
    # Re-inserting the same pages it matched returns nothing to free.
    match = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert cache.insert([1, 2, 3, 4, 5, 6], match.pages) == []
    assert cache.num_pages == 4


def test_locked_pages_are_not_evicted_and_lru_goes_first() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([5, 6], [5, 6])
    cache.insert([1, 2, 7], [11, 12, 7])  # shares [1, 2]: returns 11, 12
    locked = cache.match([5, 6, 0])
    cache.lock(locked)
    assert cache.num_evictable_pages == 4  # [1, 2], [3] and [7]; [5, 6] locked
    freed = cache.evict(1)
    assert freed == [3]  # the least recently used leaf
    assert sorted(cache.evict(10)) == [1, 2, 7]
    assert cache.num_pages == 2 and cache.evict(10) == []
    cache.unlock(locked)
    assert sorted(cache.evict(10)) == [5, 6]


def test_flush_refuses_while_locked() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [1, 2])
    match = cache.match([1, 2, 3])
    cache.lock(match)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(match)
    assert sorted(cache.reset()) == [1, 2]


def test_manager_release_and_integrity() -> None:
    kv = KVManager(num_pages=9, page_size=2, max_requests=2, max_pages_per_request=4, cache="radix")
    slot = kv.table.alloc_slot()
    pages = kv.allocate(3)
    tokens = [1, 2, 3, 4, 5]
    kv.check_integrity([pages], [slot])
    # 5 tokens computed: two whole pages cached, the third freed.
    kv.release(tokens, pages, None, kv_done=5, slot=slot)
    kv.check_integrity([], [])
    assert kv.cache.num_pages == 2 and kv.allocator.num_free == 6
    # Allocation beyond the free list evicts cached pages.
    assert len(kv.allocate(8)) == 8 and kv.cache.num_pages == 0
    with pytest.raises(AssertionError, match="out of place"):
        kv.check_integrity([], [])  # 8 pages allocated but claimed by nobody
