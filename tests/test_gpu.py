"""On a CUDA device. The rest of the suite already runs there (device "auto"
picks CUDA, so every fp32 greedy-vs-transformers test checks the CUDA path);
these add what only a GPU has: half precision as the math dtype, the engine
stream with overlap, and the pool sized from its share of device memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from hf_reference import hf_encode

pytestmark = pytest.mark.gpu

PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily and Tom were"]
# A half-precision logit is off by up to ~1e-2 of its size; the chosen token
# may differ from transformers' only where the top two are that close.
TOLERANCE = {"bfloat16": 0.15, "float16": 0.03}


def hf_logprobs_of(path: Path, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of `ids`, on CUDA, in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def test_auto_device_is_cuda_and_pool_fits_the_memory_share(llama_path: Path) -> None:
    llm = LLM(str(llama_path), mem_fraction_static=0.05)
    engine = llm.engine
    assert engine.device.type == "cuda" and engine.pool.buffer.device.type == "cuda"
    assert engine.num_pages > 2
    out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    llm.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_follows_transformers_on_cuda(stories_path: Path, dtype: str) -> None:
    llm = LLM(str(stories_path), dtype=dtype, page_size=16)
    assert llm.engine.dtype == getattr(torch, dtype)
    prompts = [hf_encode(stories_path, p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0))
    llm.close()
    tol = TOLERANCE[dtype]
    for prompt, out in zip(prompts, outs):
        # Teacher-forced: transformers scores the sequence we produced, so one
        # near-tie does not derail the rest of the comparison.
        ref = hf_logprobs_of(stories_path, getattr(torch, dtype), prompt + out.token_ids)
        for step, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + step]
            assert row[token] >= row.max() - tol, f"step {step}: not transformers' argmax"
            assert abs(logprob - row[token].item()) < tol


def test_overlap_on_the_engine_stream_matches_sequential(stories_path: Path) -> None:
    prompts = [hf_encode(stories_path, p) for p in PROMPTS * 4]
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=11, ignore_eos=True)
    results = []
    for overlap in (True, False):
        llm = LLM(str(stories_path), dtype="float32", overlap=overlap, page_size=4)
        results.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.close()
    assert results[0] == results[1]
