"""The native CPU decode-attention kernel agrees with its torch twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.attention.torch_native import TorchNativeBackend
from aioserve.batch_plan import BatchPlan
from aioserve.kvcache.kv_pool import KVPool
from aioserve.cpu.native import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")


def decode_plan(lens: list[int], page_size: int, num_pages: int, generator: torch.Generator) -> BatchPlan:
    """A decode-only plan over random, shuffled pages (page 0 stays reserved)."""
    width = -(-max(lens) // page_size)
    pages = (torch.randperm(num_pages - 1, generator=generator)[: len(lens) * width] + 1).view(len(lens), width)
    seq_lens = torch.tensor(lens)
    last = seq_lens - 1
    out_loc = pages[torch.arange(len(lens)), last // page_size].long() * page_size + last % page_size
    return BatchPlan(
        step=0, input_ids=torch.zeros(len(lens), dtype=torch.long), positions=last, out_cache_loc=out_loc,
        seq_lens=seq_lens, extend_lens=torch.ones(len(lens), dtype=torch.long), page_table=pages.int(),
        num_decodes=len(lens), logits_indices=torch.arange(len(lens)), sampling=None,
    )


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 8)])
@pytest.mark.parametrize("page_size,window", [(1, None), (16, None), (4, 7)])
# 64, 128, 256: bf16 q and cache take attention.cpp's bf16 span on AVX-512
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_kernel_matches_torch(dtype, kv_dtype, heads, kv_heads, page_size, window, dim) -> None:
    generator = torch.Generator().manual_seed(heads * 31 + page_size + dim)
    lens = [1, 5, 33, 70, 17]
    pool = KVPool(1, 400, page_size, kv_heads, dim, kv_dtype, torch.device("cpu"))
    pool.buffer[:, :, page_size:].normal_(generator=generator)
    plan = decode_plan(lens, page_size, 400, generator)
    q = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    k = torch.randn(len(lens), kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(len(lens), kv_heads, dim, generator=generator).to(dtype)
    native = TorchNativeBackend(pool, use_native=True).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    reference = TorchNativeBackend(pool, use_native=False).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    tolerance = 1e-5 if dtype == kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native, reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_takes_heads_past_one_vector(dtype) -> None:
    """40 query heads over 8 KV heads: the bf16 span keeps 16 heads' scores a
    vector, so 40 are two whole vectors and a part; spans of odd lengths
    end inside a block of positions."""
    generator = torch.Generator().manual_seed(40)
    lens, page_size, heads, kv_heads, dim = [1, 2, 31, 64, 77], 16, 40, 8, 128
    pool = KVPool(1, 60, page_size, kv_heads, dim, dtype, torch.device("cpu"))
    pool.buffer[:, :, page_size:].normal_(generator=generator)
    plan = decode_plan(lens, page_size, 60, generator)
    q = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, len(lens), kv_heads, dim, generator=generator).to(dtype)
    native = TorchNativeBackend(pool, use_native=True).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, None)
    reference = TorchNativeBackend(pool, use_native=False).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, None)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native, reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("heads,kv_heads", [(3, 1), (12, 4), (10, 2), (12, 2), (14, 2), (8, 1), (16, 1)],
                         ids=["group 3", "group 3 x 4", "group 5", "group 6", "group 7", "group 8", "group 16"])
@pytest.mark.parametrize("page_size,window", [(16, None), (4, 7)])
@pytest.mark.parametrize("dim", [64, 256])
def test_bf16_span_takes_every_group(heads, kv_heads, page_size, window, dim) -> None:
    """The bf16 span scores a KV head's group of query heads over 16 / group
    positions at a time (groups 1-8; past 8 the generic span): spans whose
    lengths are not a multiple of that, and every group size models use."""
    generator = torch.Generator().manual_seed(heads * 7 + kv_heads + page_size + dim)
    lens = [1, 2, 3, 17, 50]
    pool = KVPool(1, 120, page_size, kv_heads, dim, torch.bfloat16, torch.device("cpu"))
    pool.buffer[:, :, page_size:].normal_(generator=generator)
    plan = decode_plan(lens, page_size, 120, generator)
    q = torch.randn(len(lens), heads, dim, generator=generator).to(torch.bfloat16)
    k, v = torch.randn(2, len(lens), kv_heads, dim, generator=generator).to(torch.bfloat16)
    native = TorchNativeBackend(pool, use_native=True).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    reference = TorchNativeBackend(pool, use_native=False).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    torch.testing.assert_close(native, reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lens,window", [([300], None), ([1000], 200), ([129, 64, 1], None), ([700, 3], 500)])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 32), (torch.bfloat16, 128)])
def test_kernel_splits_few_long_sequences(lens, window, dtype, dim) -> None:
    """Fewer requests than threads x 2: each sequence is cut into chunks whose
    partial softmaxes are merged; the result is the same attention."""
    generator = torch.Generator().manual_seed(len(lens))
    page_size, heads, kv_heads = 16, 8, 2
    pool = KVPool(1, 200, page_size, kv_heads, dim, dtype, torch.device("cpu"))
    pool.buffer[:, :, page_size:].normal_(generator=generator)
    plan = decode_plan(lens, page_size, 200, generator)
    q = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, len(lens), kv_heads, dim, generator=generator).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)  # splits follow the thread count
    try:
        native = TorchNativeBackend(pool, use_native=True).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    finally:
        torch.set_num_threads(previous)
    reference = TorchNativeBackend(pool, use_native=False).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native, reference, atol=tolerance, rtol=tolerance)


def test_greedy_outputs_equal_with_and_without_the_kernel(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["mistral"]  # sliding window on every layer
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time there was a little robot", "The quick brown fox", "a"]
    native = LLM(str(path), page_size=4, device="cpu")
    plain = LLM(str(path), page_size=4, device="cpu")
    plain.engine.attention = TorchNativeBackend(plain.engine.pool, use_native=False)
    assert native.engine.attention.kernels is not None
    assert [o.token_ids for o in native.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    native.close()
    plain.close()
