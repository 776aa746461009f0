"""Logprobs in the two shapes OpenAI uses: the legacy completions object and
the chat `content` list."""

from __future__ import annotations

from aioserve.output_stream import TopLogprobs
from aioserve.server.output.completion_bodies import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from aioserve.tokenizer import IncrementalDetokenizer, Tokenizer


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[TopLogprobs | None],
    text_offsets: list[int],
) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[tokenizer.token_text(t) for t in token_ids],
        token_logprobs=logprobs,
        top_logprobs=[_top_dict(tokenizer, *position) for position in zip(token_ids, logprobs, tops)],
        text_offset=text_offsets,
    )


def _top_dict(tokenizer: Tokenizer, chosen: int, logprob: float | None, top: TopLogprobs | None) -> dict | None:
    """The N most likely tokens, and the chosen one when it is not among
    them: OpenAI's legacy logprobs "always return the logprob of the sampled
    token, so there may be up to logprobs+1 elements"."""
    if top is None:
        return None
    entries = {tokenizer.token_text(t): lp for t, lp in top}
    if logprob is not None and all(t != chosen for t, _ in top):
        entries.setdefault(tokenizer.token_text(chosen), logprob)
    return entries


def prompt_text_offsets(tokenizer: Tokenizer, prompt_ids: list[int]) -> list[int]:
    """Where each prompt token's text starts in the prompt's text. Counted on
    the detokenized text, not on token strings: a BOS that the text does not
    show takes no room, and SentencePiece's first word has no leading space."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    offsets, length = [], 0
    for token_id in prompt_ids:
        offsets.append(length)
        length += len(detok.step(token_id))
    return offsets


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], tops: list[TopLogprobs | None]
) -> ChatLogprobs:
    content = []
    for token_id, logprob, top in zip(token_ids, logprobs, tops):
        entry = _top(tokenizer, token_id, logprob)
        content.append(
            TokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                bytes=entry.bytes,
                top_logprobs=[_top(tokenizer, t, lp) for t, lp in (top or [])],
            )
        )
    return ChatLogprobs(content=content, refusal=None)
