"""--kv-cache-dtype fp8_e4m3 (alias fp8): an e4m3 KV cache on CUDA, read
by FlashInfer's kernels (kv_data_type) or upcast by the torch backend;
refused on a CPU with a message that says what to use; values saturate at
e4m3's largest instead of turning NaN."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.kvcache.kv_pool import FP8_KV, to_cache_dtype
from hf_reference import hf_encode
from test_greedy_matches_hf import PROMPTS
from tiny_models import build_checkpoint


@pytest.fixture(scope="module")
def qwen3_64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64: one FlashInfer has kernels for."""
    return build_checkpoint("qwen3", tmp_path_factory.mktemp("fp8kv") / "qwen3", overrides={"head_dim": 64})


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8"])
def test_refused_on_cpu_naming_what_to_use(name: str, qwen3_64: Path) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device.*use auto, bfloat16"):
        LLM(str(qwen3_64), device="cpu", kv_cache_dtype=name)


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
