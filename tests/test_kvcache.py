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


def test_share_computed_pages_of_running_requests() -> None:
    kv = KVManager(num_pages=12, page_size=2, max_requests=2, max_pages_per_request=4, cache="radix")
    tokens = [1, 2, 3, 4, 5, 6]
    # Two requests computed the same prompt side by side, each in its own pages.
    slot_a, slot_b = kv.table.alloc_slot(), kv.table.alloc_slot()
    pages_a, pages_b = kv.allocate(3), kv.allocate(3)
    kv.table.write(slot_a, 0, pages_a)
    kv.table.write(slot_b, 0, pages_b)
    # A shares its two complete pages (5 tokens computed); the cache adopts them.
    pages_a, match_a = kv.share_computed(tokens, pages_a, None, kv_done=5, slot=slot_a)
    assert match_a.num_tokens == 4 and kv.cache.num_pages == 2 and kv.cache.num_evictable_pages == 0
    kv.check_integrity([pages_a[2:], pages_b], [slot_a, slot_b])  # B still owns all three of its own
    # B shares next: its copies are redundant, it switches to A's and frees its own.
    free_before = kv.allocator.num_free
    pages_b, match_b = kv.share_computed(tokens, pages_b, None, kv_done=6, slot=slot_b)
    assert pages_b[:2] == pages_a[:2] and kv.allocator.num_free == free_before + 2
    assert kv.table.rows([slot_b], 3).tolist() == [pages_b]
    kv.check_integrity([pages_a[2:], pages_b[3:]], [slot_a, slot_b])
    # B's third page is complete too (6 tokens): it joins the cache under A's two.
    assert match_b.num_tokens == 6 and kv.cache.num_pages == 3
    # Nothing new to share: unchanged.
    assert kv.share_computed(tokens, pages_b, match_b, kv_done=6, slot=slot_b) == (pages_b, match_b)
    kv.release(tokens, pages_a, match_a, kv_done=6, slot=slot_a)
    kv.release(tokens, pages_b, match_b, kv_done=6, slot=slot_b)
    kv.check_integrity([], [])
    assert kv.cache.num_evictable_pages == kv.cache.num_pages == 3


def test_naive_cache_shares_nothing() -> None:
    kv = KVManager(num_pages=6, page_size=2, max_requests=1, max_pages_per_request=4, cache="naive")
    slot, pages = kv.table.alloc_slot(), kv.allocate(2)
    assert kv.share_computed([1, 2, 3, 4], pages, None, kv_done=4, slot=slot) == (pages, None)
