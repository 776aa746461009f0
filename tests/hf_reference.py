"""Hugging Face transformers as the oracle: greedy ids and their logprobs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@lru_cache(maxsize=8)
def hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int, model=None) -> tuple[list[int], list[float]]:
    """transformers' generate(do_sample=False), EOS ignored; ids and each
    chosen token's log_softmax. `model`: one loaded from `path` and altered
    by the test (default: as loaded)."""
    model = model if model is not None else hf_model(str(path))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
    return ids, logprobs


def hf_encode(path: Path, text: str) -> list[int]:
    return hf_tokenizer(str(path))(text).input_ids
