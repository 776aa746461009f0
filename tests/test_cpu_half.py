"""bfloat16 math on the CPU (what `--dtype auto` picks for a bf16 checkpoint
on a CPU with AVX512-BF16/AMX) follows transformers within half-precision
tolerance, teacher-forced as tests/test_gpu.py does on CUDA. Forced with
cpu_half_compute="native" so every machine runs it (emulated where the CPU
lacks the units: slower, same rounding)."""

from __future__ import annotations

from pathlib import Path

import torch

from aioserve import LLM, SamplingParams
from hf_reference import hf_encode

PROMPTS = ["Once upon a time", "The little dog ran to the park and"]
TOLERANCE = 0.15  # a bf16 logit is off by up to ~1e-2 of its size


def hf_bf16_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_bfloat16_on_cpu_follows_transformers(stories_path: Path) -> None:
    llm = LLM(str(stories_path), dtype="bfloat16", cpu_half_compute="native", device="cpu", page_size=4)
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.kv_dtype == torch.bfloat16
    prompts = [hf_encode(stories_path, p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0))
    llm.close()
    assert_follows_transformers_bf16(stories_path, prompts, outs)


def assert_follows_transformers_bf16(path: Path, prompts: list[list[int]], outs: list) -> None:
    """Each output token is transformers' bf16 argmax (teacher-forced) within
    TOLERANCE, and its logprob within TOLERANCE of transformers'."""
    for prompt, out in zip(prompts, outs):
        ref = hf_bf16_logprobs(path, prompt + out.token_ids)
        for step, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + step]
            assert row[token] >= row.max() - TOLERANCE, f"step {step}: not transformers' argmax"
            assert abs(logprob - row[token].item()) < TOLERANCE
