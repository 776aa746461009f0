"""vLLM's `prompt_logprobs` response field: for each prompt token after the
first, a mapping from token id (a string, JSON's keys are) to its logprob,
its rank in that position's distribution (1: the likeliest) and its text;
the prompt's own token is always listed, beside the N likeliest."""

from __future__ import annotations

from typing import Any

from aioserve.output_stream import OutputStream
from aioserve.tokenizer import Tokenizer


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], stream: OutputStream, num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    entries = list(stream.prompt_logprobs or [])
    ranks = stream.prompt_logprob_ranks
    listing: list[dict[str, dict[str, Any]] | None] = [None]
    for position in range(1, len(prompt_ids)):
        entry = entries[position] if position < len(entries) else None
        if entry is None:
            listing.append(None)
            continue
        logprob, top = entry
        token = prompt_ids[position]
        rank = ranks[position - 1] if position - 1 < len(ranks) else None
        mapping: dict[str, dict[str, Any]] = {}
        for place, (top_id, top_logprob) in enumerate(top[:num_top], start=1):
            mapping[str(top_id)] = {"logprob": top_logprob, "rank": place, "decoded_token": tokenizer.token_text(top_id)}
        # The prompt's own token first, as vLLM lists it (its rank may be past N).
        own = {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token)}
        listing.append({str(token): own, **{k: v for k, v in mapping.items() if k != str(token)}})
    return listing
