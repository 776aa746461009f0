"""--kv-cache-dtype fp8_e4m3 (alias fp8): an e4m3 KV cache on CUDA, read
by FlashInfer's kernels (kv_data_type) or upcast by the torch backend; on a
CPU stored and read by the native kernels (the DecoderStack's decode steps
included); values saturate at e4m3's largest instead of turning NaN."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.cpu.native import cpu_kernels
from aioserve.cpu_engine.decode_stack import NativeDecodeRunner
from aioserve.kvcache.kv_pool import FP8_KV, to_cache_dtype
from hf_reference import hf_encode
from test_greedy_matches_hf import PROMPTS
from tiny_models import build_checkpoint


@pytest.fixture(scope="module")
def qwen3_64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64: one FlashInfer has kernels for."""
    return build_checkpoint("qwen3", tmp_path_factory.mktemp("fp8kv") / "qwen3", overrides={"head_dim": 64})


def _prompt_logprobs(model: Path, kv: str, **options: object) -> tuple[torch.Tensor, list[list[int]], LLM]:
    prompts = [hf_encode(model, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    llm = LLM(str(model), dtype="bfloat16", kv_cache_dtype=kv, page_size=16, **options)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 16 for o in outs)
    logprobs = [e[0] for o in outs for e in o.prompt_logprobs if e is not None]
    return torch.tensor(logprobs), [o.token_ids for o in outs], llm


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8"])
def test_fp8_cache_on_cpu(name: str, qwen3_64: Path) -> None:
    """The CPU stores and reads an e4m3 cache (half the bytes of a bf16
    one): prompt logprobs stay near the bf16 cache's, and greedy decoding
    runs through prefill and the native whole-step decodes; the same
    tokens whether the decodes go through the modules or the native step."""
    reference, _, llm = _prompt_logprobs(qwen3_64, "bfloat16", device="cpu")
    bf16_bytes = llm.engine.pool.buffer[0, 0, 0].nbytes  # one slot's keys
    llm.close()
    got, tokens, llm = _prompt_logprobs(qwen3_64, name, device="cpu")
    try:
        assert llm.engine.kv_dtype == FP8_KV and llm.engine.pool.buffer.dtype == FP8_KV
        assert llm.engine.pool.buffer[0, 0, 0].nbytes * 2 == bf16_bytes
        if cpu_kernels() is not None:  # the decodes ran as the native whole step, its store and attention on e4m3
            runner = llm.engine.graph_runner
            assert isinstance(runner, NativeDecodeRunner) and runner.replays > 0
        assert got.isfinite().all() and (got - reference).abs().mean() < 0.1
    finally:
        llm.close()
    _, eager_tokens, llm = _prompt_logprobs(qwen3_64, name, device="cpu", cuda_graph=False)
    llm.close()
    assert eager_tokens == tokens


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim,heads,kv_heads", [(128, 16, 8), (64, 4, 2), (32, 4, 4)])
def test_native_decode_attention_reads_an_fp8_cache(q_dtype: torch.dtype, dim: int, heads: int, kv_heads: int) -> None:
    """paged_decode_attention over e4m3 caches equals attention written out
    over their float32 values (dims 64 and 128: the vector kernel; 32: the
    generic span), pages scattered, lengths across page boundaries."""
    kernels = cpu_kernels(wait=True)
    if kernels is None:
        pytest.skip("the native kernels did not build")
    generator = torch.Generator().manual_seed(dim)
    page_size, lens, pages_per_row = 16, torch.tensor([1, 17, 40, 64, 100]), 8
    batch, total = len(lens), len(lens) * pages_per_row + 1
    keys = (torch.randn(total * page_size, kv_heads, dim, generator=generator) * 2).to(FP8_KV)
    values = torch.randn(total * page_size, kv_heads, dim, generator=generator).to(FP8_KV)
    pages = (torch.randperm(total - 1, generator=generator)[: batch * pages_per_row] + 1).view(batch, -1).int()
    q = torch.randn(batch, heads, dim, generator=generator).to(q_dtype)
    out = kernels.paged_decode_attention(q, keys, values, pages, lens, page_size, dim**-0.5, 0)
    assert out.dtype == q_dtype
    for b, length in enumerate(lens.tolist()):
        slots = (pages[b].long()[:, None] * page_size + torch.arange(page_size)).flatten()[:length]
        k = keys[slots].float().repeat_interleave(heads // kv_heads, 1)
        v = values[slots].float().repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("hd,lhd->hl", q[b].float(), k) * dim**-0.5).softmax(-1)
        want = torch.einsum("hl,lhd->hd", weights, v)
        tolerance = 1e-5 if q_dtype == torch.float32 else 2 ** -8 * want.abs().max().item() * 2
        assert (out[b].float() - want).abs().max().item() <= tolerance


def test_the_native_store_rounds_as_torch() -> None:
    """store_kv into an e4m3 cache writes the bytes to_cache_dtype (torch)
    gives: rounding to nearest even, subnormals, saturation at +-448, from
    float32 and bf16 rows."""
    kernels = cpu_kernels(wait=True)
    if kernels is None:
        pytest.skip("the native kernels did not build")
    generator = torch.Generator().manual_seed(0)
    spread = [torch.randn(2000, generator=generator) * scale for scale in (1e-4, 1e-2, 1.0, 100.0, 1e4)]
    edges = torch.tensor([0.0, -0.0, 448.0, -449.0, 464.0, 465.0, 1e9, 2**-6, 2**-9, 1.5 * 2**-9, 2.5 * 2**-9,
                          1.0625, 1.1875, 232.0, 248.0])
    for source in (torch.cat([*spread, edges]), torch.cat([*spread, edges]).bfloat16()):
        rows = source.view(-1, 1, 1)
        keys, values = (torch.zeros(rows.shape, dtype=FP8_KV) for _ in range(2))
        kernels.store_kv(rows, -rows, keys, values, torch.arange(rows.shape[0]))
        assert torch.equal(keys.view(torch.uint8), to_cache_dtype(rows, FP8_KV).view(torch.uint8))
        assert torch.equal(values.view(torch.uint8), to_cache_dtype(-rows, FP8_KV).view(torch.uint8))


def test_e5m2_is_refused(qwen3_64: Path) -> None:
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported"):
        LLM(str(qwen3_64), device="cpu", kv_cache_dtype="fp8_e5m2")


def test_values_saturate() -> None:
    t = torch.tensor([0.5, -3.0, 500.0, -1e6])
    stored = to_cache_dtype(t, FP8_KV)
    assert stored.dtype == FP8_KV and not stored.float().isnan().any()
    assert stored.float().tolist() == [0.5, -3.0, 448.0, -448.0]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_native", "flashinfer"])
def test_fp8_cache_on_cuda(backend: str, qwen3_64: Path) -> None:
    """Prompt logprobs with an e4m3 cache stay near the bfloat16 cache's;
    greedy decoding runs through prefill, decode and CUDA graphs."""
    from aioserve.flashinfer.loader import load_flashinfer

    if backend == "flashinfer" and load_flashinfer() is None:
        pytest.skip("flashinfer does not import (the gpu extra)")
    prompts = [hf_encode(qwen3_64, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    results = []
    for kv in ("bfloat16", "fp8_e4m3"):
        llm = LLM(str(qwen3_64), dtype="bfloat16", kv_cache_dtype=kv, attention_backend=backend, page_size=16)
        try:
            assert llm.engine.kv_dtype == (FP8_KV if kv.startswith("fp8") else torch.bfloat16)
            outs = llm.generate(prompts, params)
            assert all(len(o.token_ids) == 16 for o in outs)
            results.append([e[0] for o in outs for e in o.prompt_logprobs if e is not None])
        finally:
            llm.close()
    reference, got = (torch.tensor(r) for r in results)
    assert got.isfinite().all() and (got - reference).abs().mean() < 0.1


def test_the_pool_stores_e4m3_bytes() -> None:
    """KVPool.store into an e4m3 pool (torch has no float8 index_copy_):
    the slots hold the saturated e4m3 values, the others stay zero."""
    from aioserve.kvcache.kv_pool import KVPool

    pool = KVPool(1, 4, 2, 2, 8, FP8_KV, torch.device("meta"))
    pool.buffer = torch.zeros(pool.buffer.shape, dtype=FP8_KV)  # on the CPU
    k, v = torch.randn(3, 2, 8) * 100, torch.randn(3, 2, 8)
    pool.store(0, torch.tensor([1, 4, 6]), k, v)
    keys, values = pool.keys(0), pool.values(0)
    assert torch.equal(keys[[1, 4, 6]].float(), to_cache_dtype(k, FP8_KV).float())
    assert torch.equal(values[[1, 4, 6]].float(), v.to(FP8_KV).float())
    assert not keys[[0, 2, 3, 5, 7]].float().any()
