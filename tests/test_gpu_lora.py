"""LoRA adapters on a GPU (issue 42): a batch mixing two adapters and the
base, on CUDA with the torch backend in float32, equals the CPU token for
token; with the default backend (FlashInfer, CUDA graphs for the base
model's steps, LoRA steps eager) in bfloat16, each request's first token
is the CPU's, or a near-tie of it (bf16 rounding can swap two tokens whose
float32 logprobs are that close). No peft here (the GPU machine lacks it): the adapters are
written in PEFT's layout by hand, and the CPU run is the reference
(tests/test_lora.py holds the CPU equal to PEFT)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioserve import LLM, GenerationOutput, SamplingParams
from lora_adapters import write_raw_adapter
from tiny_models import build_checkpoint

PROMPTS = [[5, 17, 33, 81, 9, 100, 42, 7], list(range(11, 40)), [200, 3, 150]]
CHOICES = [None, "a", "b"]


# Natural-log units: how far bf16 rounding moves a logprob here at most.
BF16_TOLERANCE = 0.15


def _outputs(checkpoint: Path, adapters: dict[str, Path], **options) -> list[GenerationOutput]:
    llm = LLM(str(checkpoint), enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()],
              max_lora_rank=16, **options)
    try:
        prompts = [p for p in PROMPTS for _ in CHOICES]
        choices = [c for _ in PROMPTS for c in CHOICES]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
        return llm.generate(prompts, params, lora_request=choices)
    finally:
        llm.close()


def _generate(checkpoint: Path, adapters: dict[str, Path], **options) -> list[list[int]]:
    return [o.token_ids for o in _outputs(checkpoint, adapters, **options)]


@pytest.mark.gpu
def test_mixed_adapters_on_cuda_equal_the_cpu(tmp_path: Path) -> None:
    checkpoint = build_checkpoint("llama", tmp_path / "llama", overrides={
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    adapters = {"a": write_raw_adapter(checkpoint, tmp_path / "a", 8, seed=1),
                "b": write_raw_adapter(checkpoint, tmp_path / "b", 16, seed=2, targets=("q_proj", "v_proj"))}
    reference = _outputs(checkpoint, adapters, device="cpu", dtype="float32")
    expected = [o.token_ids for o in reference]
    assert _generate(checkpoint, adapters, device="cuda", dtype="float32", attention_backend="torch_native") == expected
    half = _generate(checkpoint, adapters, device="cuda", dtype="bfloat16")
    for tokens, ref in zip(half, reference, strict=True):
        first, top = tokens[0], dict(ref.top_logprobs[0] or [])
        assert first == ref.token_ids[0] or (
            first in top and top[ref.token_ids[0]] - top[first] < BF16_TOLERANCE), "not a near-tie of the CPU's"
