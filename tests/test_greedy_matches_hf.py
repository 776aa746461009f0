"""Greedy generation through LLM.generate equals transformers', token for
token, with logprobs within 1e-4 (fp32, CPU), for every architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioserve import LLM, SamplingParams
from hf_reference import hf_encode, hf_greedy
from tiny_models import ARCHITECTURES

PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and the robot walked to the library to read",
    "Héllo wörld 世界 🙂 " * 6,
    "a",
    " ".join(["every morning the robot read about fish whales boats and storms"] * 5),
]
NEW_TOKENS = 24


def check_against_hf(path: Path, llm: LLM, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outputs):
        ref_ids, ref_logprobs = hf_greedy(path, ids, NEW_TOKENS)
        assert out.token_ids == ref_ids, f"prompt of {len(ids)} tokens diverged"
        assert out.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs)) < 1e-4


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tiny_checkpoint_matches_hf(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints[arch]
    llm = LLM(str(path), page_size=4)
    check_against_hf(path, llm, [hf_encode(path, p) for p in PROMPTS])
    llm.close()


def test_stories260k_matches_hf_and_reference(stories_path: Path) -> None:
    llm = LLM(str(stories_path))
    check_against_hf(stories_path, llm, [hf_encode(stories_path, p) for p in PROMPTS[:2]] + [[1]])
    # The figures shared/models/README.md documents for this checkpoint.
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0, logprobs=5))[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    assert out.token_ids == [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
    assert out.text == ", there was a little girl named Lily. She loved to play"
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == [432, 383, 322, 353, 323]
    assert top[0][1] == pytest.approx(-0.0317, abs=1e-4) and top[1][1] == pytest.approx(-3.5498, abs=1e-4)
    llm.close()
