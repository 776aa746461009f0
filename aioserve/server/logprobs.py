"""Logprobs in the two shapes OpenAI uses: the legacy completions object and
the chat `content` list."""

from __future__ import annotations

from typing import Any

from aioserve.output_stream import TopLogprobs
from aioserve.tokenizer import Tokenizer


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[TopLogprobs | None],
    text_offset: int = 0,
) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
    tokens = [tokenizer.token_text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [
            None if top is None else {tokenizer.token_text(t): lp for t, lp in top} for top in tops
        ],
        "text_offset": offsets,
    }


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], tops: list[TopLogprobs | None]
) -> dict[str, Any]:
    content = []
    for token_id, logprob, top in zip(token_ids, logprobs, tops):
        entry = _entry(tokenizer, token_id, logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in (top or [])]
        content.append(entry)
    return {"content": content}
