"""Radix cache, allocator and the page bookkeeping invariant."""

from __future__ import annotations

import pytest
import torch

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


def test_a_walk_costs_the_prompt_not_the_prompt_per_node() -> None:
    """A 32k-token prompt inserted 32 tokens at a time (chunked prefill) is
    a chain of 1000 nodes; a walk that copied the prompt at each node took
    63 ms (prompt x nodes), one that compares each node's run at once 2.5 ms.
    n copies of a prompt walk it three times each, on the event loop. Timed
    as a ratio to the same prompt held in one node (the machine's load
    cancels): ~5x now, ~100x with the copying walk."""
    import time

    tokens = [5] * 32_000
    chain, whole = RadixCache(page_size=16), RadixCache(page_size=16)
    for end in range(32, len(tokens) + 1, 32):
        chain.insert(tokens[:end], list(range(end // 16)))
    whole.insert(tokens, list(range(2000)))

    def best_match_seconds(cache: RadixCache) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            match = cache.match(tokens)
            times.append(time.perf_counter() - start)
        assert match.num_tokens == 32_000 - 16 and match.pages == list(range(1999))
        return min(times)

    assert best_match_seconds(chain) < 25 * best_match_seconds(whole)


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
    tokens = [1, 2, 3, 4, 5]
    handle = kv.admit(tokens)
    assert handle is not None and len(handle.own_pages) == 3 and handle.kv_done == 0
    kv.check_integrity([handle])
    # 5 tokens computed: two whole pages cached, the third freed.
    handle.computed(5)
    kv.release(handle, tokens)
    kv.check_integrity([])
    assert kv.cache.num_pages == 2 and kv.allocator.num_free == 6
    with pytest.raises(RuntimeError, match="after release"):
        handle.computed(6)
    # Allocation beyond the free list evicts cached pages.
    assert len(kv.allocate(8)) == 8 and kv.cache.num_pages == 0
    with pytest.raises(AssertionError, match="out of place"):
        kv.check_integrity([])  # 8 pages allocated but claimed by nobody


def test_share_computed_pages_of_running_requests() -> None:
    kv = KVManager(num_pages=12, page_size=2, max_requests=2, max_pages_per_request=4, cache="radix")
    tokens = [1, 2, 3, 4, 5, 6]
    # Two requests computed the same prompt side by side, each in its own pages.
    a, b = kv.admit(tokens), kv.admit(tokens)
    assert a is not None and b is not None and a.slot != b.slot
    pages_a, pages_b = a.pages, b.pages
    # A shares its two complete pages (5 tokens computed); the cache adopts them.
    a.computed(5)
    kv.share_computed(a, tokens)
    assert a.prefix.num_tokens == 4 and kv.cache.num_pages == 2 and kv.cache.num_evictable_pages == 0
    assert a.pages == pages_a and a.own_pages == pages_a[2:]
    kv.check_integrity([a, b])  # B still owns all three of its own
    # B shares next: its copies are redundant, it switches to A's and frees its own.
    free_before = kv.allocator.num_free
    b.computed(6)
    kv.share_computed(b, tokens)
    assert b.pages[:2] == pages_a[:2] and kv.allocator.num_free == free_before + 2
    assert kv.table.rows([b.slot], 3).tolist() == [b.pages]
    assert b.own_pages == [] and b.pages[2] == pages_b[2]
    kv.check_integrity([a, b])
    # B's third page is complete too (6 tokens): it joins the cache under A's two.
    assert b.prefix.num_tokens == 6 and kv.cache.num_pages == 3
    # Nothing new to share: unchanged.
    before = (b.pages, b.prefix)
    kv.share_computed(b, tokens)
    assert (b.pages, b.prefix) == before
    a.computed(6)
    kv.release(a, tokens)
    kv.release(b, tokens)
    kv.check_integrity([])
    assert kv.cache.num_evictable_pages == kv.cache.num_pages == 3


def test_naive_cache_shares_nothing() -> None:
    kv = KVManager(num_pages=6, page_size=2, max_requests=1, max_pages_per_request=4, cache="naive")
    handle = kv.admit([1, 2, 3, 4])
    assert handle is not None
    pages = handle.pages
    handle.computed(4)
    kv.share_computed(handle, [1, 2, 3, 4])
    assert handle.pages == pages and handle.prefix.num_tokens == 0


def test_kv_handle_lifecycle_keeps_integrity() -> None:
    """admit / extend / share / preempt (release) / readmit / release: the
    integrity check holds after every move, and the cache serves the
    preempted request's computed pages back at readmission."""
    kv = KVManager(num_pages=10, page_size=2, max_requests=2, max_pages_per_request=8, cache="radix")
    prompt = [5, 6, 7, 8, 9]
    first = kv.admit(prompt)
    assert first is not None and first.kv_len == first.kv_done == 0
    kv.check_integrity([first])
    # A second request sharing no prefix; the pool keeps headroom for it.
    other = kv.admit([1, 1, 1], headroom_pages=2)
    assert other is not None
    kv.check_integrity([first, other])
    # Prefill computed, then decoding grows it page by page.
    first.scheduled(5)
    first.computed(5)
    kv.share_computed(first, prompt)
    kv.check_integrity([first, other])
    tokens = prompt + [10, 11, 12]
    for length in (6, 7, 8):
        assert kv.extend(first, length)
        first.scheduled(length)
        first.computed(length - 1)  # the newest token's KV lands a step later
        kv.check_integrity([first, other])
    assert first.num_pages == kv.pages_for(8)
    # Ask for more than the pool has: refused, nothing changes.
    held = first.pages
    assert not kv.extend(first, 2 * 8) and first.pages == held
    kv.check_integrity([first, other])
    # Preempt: computed whole pages go to the cache, the rest is freed.
    kv.release(first, tokens)
    kv.check_integrity([other])
    assert kv.cache.num_pages == 3  # 7 computed tokens = 3 whole pages
    # Readmission matches them (never the last token) and needs one page more.
    again = kv.admit(tokens)
    assert again is not None and again.kv_done == again.prefix.num_tokens == 6
    assert len(again.own_pages) == 1
    kv.check_integrity([again, other])
    # Admission that cannot keep the asked headroom holds nothing.
    free = kv.allocator.num_free
    assert kv.admit([3, 3, 3, 3], headroom_pages=kv.num_available_pages) is None
    assert kv.allocator.num_free == free
    kv.check_integrity([again, other])
    again.computed(8)
    kv.release(again, tokens)
    kv.release(other, [1, 1, 1])
    kv.check_integrity([])
    assert kv.allocator.num_free + kv.cache.num_evictable_pages == kv.num_usable_pages


def test_k_and_v_adjacent_in_a_fused_projection_are_written_in_one_copy() -> None:
    """k and v as views of one q|k|v row (nothing replaced k) go into the pool
    with one index_copy_ (one kernel on a GPU); a k computed apart (Qwen3's
    normed k) takes the two copies. Both write the same values."""
    from aioserve.kvcache.kv_pool import KVPool, adjacent_pair

    tokens, heads, dim = 3, 2, 4
    qkv = torch.randn(tokens, (4 + 2 * heads) * dim)
    k = qkv[:, 4 * dim : (4 + heads) * dim].reshape(tokens, heads, dim)
    v = qkv[:, (4 + heads) * dim :].reshape(tokens, heads, dim)
    pair = adjacent_pair(k, v)
    assert pair is not None and torch.equal(pair[0], k) and torch.equal(pair[1], v)
    assert adjacent_pair(k.clone(), v) is None and adjacent_pair(v, k) is None
    slots = torch.tensor([5, 9, 2])
    pools = [KVPool(1, 4, 4, heads, dim, torch.float32, torch.device("cpu")) for _ in range(2)]
    from aioserve.cpu import elementwise

    saved, elementwise.ENABLED = elementwise.ENABLED, False  # the torch path, not the native kernel
    try:
        pools[0].store(0, slots, k, v)
        pools[1].store(0, slots, k.clone(), v.clone())
    finally:
        elementwise.ENABLED = saved
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    assert torch.equal(pools[0].keys(0)[slots], k) and torch.equal(pools[0].values(0)[slots], v)


def test_a_cpu_pool_asks_for_huge_pages_before_it_is_zeroed() -> None:
    """The CPU pool is advised into 2 MiB pages before its first touch (where
    the OS lends them on request or always), and is all zeros either way."""
    from pathlib import Path

    from aioserve.cpu.huge_pages import advise_huge_pages
    from aioserve.kvcache.kv_pool import KVPool

    pool = KVPool(2, 300, 16, 8, 128, torch.bfloat16, torch.device("cpu"))  # ~19 MiB
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    lent = thp.exists() and "[never]" not in thp.read_text()
    assert pool.huge_pages == lent
    assert not pool.buffer.any()
    assert not advise_huge_pages(torch.empty(1024))  # too small for a whole huge page
