"""Prefill chunks attended together equal each chunk attended alone: side-by-
side fresh chunks of one length go through one batched call (torch_native)."""

from __future__ import annotations

import pytest
import torch

from aioserve.attention.torch_native import TorchNativeBackend
from aioserve.batch_plan import BatchPlan
from aioserve.kvcache.kv_pool import KVPool

PAGE = 4


def extend_plan(chunks: list[tuple[int, int]], first_page: int) -> BatchPlan:
    """One request per (prefix, length): its tokens at positions prefix.., on
    pages of its own from `first_page` on."""
    ids, positions, slots, rows = [], [], [], []
    width = max(-(-(prefix + length) // PAGE) for prefix, length in chunks)
    page = first_page
    for prefix, length in chunks:
        pages = list(range(page, page + width))
        page += width
        rows.append(pages)
        for pos in range(prefix, prefix + length):
            positions.append(pos)
            slots.append(pages[pos // PAGE] * PAGE + pos % PAGE)
            ids.append(0)
    return BatchPlan(
        step=0, input_ids=torch.tensor(ids), positions=torch.tensor(positions), out_cache_loc=torch.tensor(slots),
        seq_lens=torch.tensor([p + n for p, n in chunks]), extend_lens=torch.tensor([n for _, n in chunks]),
        page_table=torch.tensor(rows, dtype=torch.int32), num_decodes=0,
        logits_indices=torch.tensor([], dtype=torch.long), sampling=None,
    )


# Three fresh chunks of 9 (one batched run), a fresh 6, a chunk after a
# cached prefix of 8, then two fresh 9s again (a second run); and two fresh
# 9s on either side of a chunk after a prefix, which the native kernels take
# a token at a time: not side by side, so not one run. Expected runs: with
# the native kernels (the prefixed chunk is paged), without.
LAYOUTS = [
    ([(0, 9), (0, 9), (0, 9), (0, 6), (8, 9), (0, 9), (0, 9)], [3, 1, 2], [3, 1, 1, 2]),
    ([(0, 9), (8, 9), (0, 9)], [1, 1], [1, 1, 1]),
]


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["runs", "paged-between"])
def test_chunks_together_equal_chunks_alone(dtype, kv_dtype, window, layout) -> None:
    chunks, paged_runs, runs = layout
    heads, kv_heads, dim = 8, 2, 16
    generator = torch.Generator().manual_seed(7)
    pool = KVPool(1, 200, PAGE, kv_heads, dim, kv_dtype, torch.device("cpu"))
    pool.buffer[:, :, PAGE:].normal_(generator=generator)  # the cached prefix reads these
    tokens = sum(n for _, n in chunks)
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    backend = TorchNativeBackend(pool)
    plan = extend_plan(chunks, first_page=1)
    metadata = backend.prepare(plan, plan)
    # The chunk after a prefix is short: the native decode kernel takes it, a token at a time.
    paged = metadata.kernels is not None
    assert [len(run) for run in metadata.extend_runs] == (paged_runs if paged else runs)
    together = metadata.attend(0, q, k, v, dim**-0.5, window)
    start = 0
    width = plan.page_table.shape[1]
    for i, (prefix, length) in enumerate(chunks):
        rows = slice(start, start + length)
        alone = extend_plan([(prefix, length)], first_page=1 + i * width)
        expected = backend.prepare(alone, alone).attend(0, q[rows], k[rows], v[rows], dim**-0.5, window)
        assert torch.equal(together[rows], expected), f"chunk {i}"
        start += length


def reference(q, keys, values, prefix, both_ways, window, scale):
    """One request's chunk, attention written out: each query sees the keys up
    to itself, or to the end of its block of rows that attend both ways,
    and none `window` or more behind it."""
    length = q.shape[0]
    q_pos = torch.arange(length)[:, None] + prefix
    k_pos = torch.arange(prefix + length)[None, :]
    last = q_pos.clone()
    for first, end in both_ways:
        last[first:end] = prefix + end - 1
    allowed = k_pos <= last
    if window is not None:
        allowed &= k_pos > q_pos - window
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1).float(), values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3])
def test_image_rows_attend_both_ways(window) -> None:
    """Gemma 3's image tokens see each other both ways: a fresh chunk with an
    image in it, a short chunk after a cached prefix that holds the rest of
    an image (never run as decodes), and a plain chunk beside them."""
    from aioserve.batch_plan import ImageBatch, ImageRows

    chunks = [(0, 9), (8, 5), (0, 7)]
    # rows (in the step) of each request's image tokens: 3..7 of the first, 9..12 of the second
    images = ImageBatch([], [], [ImageRows(3, 1, 0, 5, bidirectional=True), ImageRows(9, 2, 4, 4, bidirectional=True)])
    heads, kv_heads, dim = 4, 2, 8
    generator = torch.Generator().manual_seed(3)
    pool = KVPool(1, 100, PAGE, kv_heads, dim, torch.float32, torch.device("cpu"))
    pool.buffer[:, :, PAGE:].normal_(generator=generator)
    q = torch.randn(21, heads, dim, generator=generator)
    k = torch.randn(21, kv_heads, dim, generator=generator)
    v = torch.randn(21, kv_heads, dim, generator=generator)
    plan = extend_plan(chunks, first_page=1)
    plan.images = images
    metadata = TorchNativeBackend(pool).prepare(plan, plan)
    assert metadata.paged_rows is None  # the short chunk with an image is not taken a token at a time
    out = metadata.attend(0, q, k, v, dim**-0.5, window)
    width = plan.page_table.shape[1]
    blocks = [[(3, 8)], [(0, 4)], []]
    start = 0
    for i, (prefix, length) in enumerate(chunks):
        rows = slice(start, start + length)
        slots = [(1 + i * width + pos // PAGE) * PAGE + pos % PAGE for pos in range(prefix + length)]
        keys, values = pool.keys(0)[slots], pool.values(0)[slots]
        expected = reference(q[rows], keys, values, prefix, blocks[i], window, dim**-0.5)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        start += length
    # without the blocks the same rows differ (the test can fail)
    plan.images = None
    plain = TorchNativeBackend(pool).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    assert not torch.allclose(plain[3:7], out[3:7])
