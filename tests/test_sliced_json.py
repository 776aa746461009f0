"""server/output/sliced_json.py writes a response model's JSON in many short
serializer calls: the bytes must be model_dump_json()'s, whatever the shape
(models inside lists inside models, omitted fields, non-finite floats as
null, a root model), and a heavy body must come in pieces no larger than a
slice."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel

from aioserve.server.output.completion_bodies import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from aioserve.server.output.generate_bodies import FinishReason, GenerateBatch, GenerateOutput, MetaInfo
from aioserve.server.output.sliced_json import SLICE_VALUES, sliced_json, weight

USAGE = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3, prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
N = 6000  # positions: × 21 logprob entries, several slices


def _completion_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[f'tok{i % 300}"\n\u00e9' for i in range(N)],
        token_logprobs=[None if i == 0 else (-math.inf if i % 7 == 0 else -0.5 * (i % 5)) for i in range(N)],
        top_logprobs=[None if i == 0 else {f"t{(i + j) % 300}": (-math.inf if j == 3 else -0.1 * j) for j in range(20)}
                      for i in range(N)],
        text_offset=list(range(N)),
    )


def _chat_logprobs(count: int) -> ChatLogprobs:
    top = [TopLogprob(token=f"b{j}", logprob=-math.inf if j == 1 else -2.0, bytes=None) for j in range(20)]
    return ChatLogprobs(content=[TokenLogprob(token='a"', logprob=-1.5, bytes=[97, 34], top_logprobs=top)
                                 for _ in range(count)])


def _meta() -> MetaInfo:
    entries = [(-1.5, 3, "a"), (None, 4, None), (-math.inf, 5, '"')] * 3000
    return MetaInfo(id="r", finish_reason=FinishReason(type="length", length=3), prompt_tokens=1, completion_tokens=1,
                    cached_tokens=0, e2e_latency=0.5, input_token_logprobs=entries,
                    input_top_logprobs=[[(-1.0, 1, "x")] * 5, None] * 3000)


BODIES: dict[str, BaseModel] = {
    "small": Completion(id="c", created=1, model="m", choices=[
        CompletionChoice(index=0, text="hi", logprobs=None, finish_reason="stop")]),
    "echo-logprobs": Completion(id="c", created=1, model="m", usage=USAGE, choices=[
        CompletionChoice(index=0, text="x" * N, logprobs=_completion_logprobs(), finish_reason="length",
                         prompt_logprobs=[None, {"5": {"logprob": -math.inf, "rank": 1, "decoded_token": "a"}}] * 3000),
        CompletionChoice(index=1, text="y", logprobs=None, finish_reason="stop", stop_reason="\n")]),
    "many-choices": Completion(id="c", created=1, model="m", usage=USAGE, choices=[
        CompletionChoice(index=i, text="hello " * (i % 50), logprobs=None, finish_reason="stop")
        for i in range(3000)]),
    "chat-logprobs": ChatCompletion(id="c", created=1, model="m", usage=USAGE, choices=[
        ChatChoice(index=i, message=ChatMessage(
            content="x", tool_calls=[{"id": "1", "function": {"name": "f", "arguments": "{}"}}] if i else None),
            logprobs=_chat_logprobs(2000 if i < 2 else 3), finish_reason="stop")
        for i in range(4)], prompt_logprobs=[None] + [{"1": {"logprob": 1.0}}] * 20000),
    "generate-batch": GenerateBatch([GenerateOutput(text="t", output_ids=list(range(20000)), meta_info=_meta())
                                     for _ in range(3)]),
    "generate-one": GenerateOutput(text="t", output_ids=[1, 2], meta_info=_meta()),
}


@pytest.mark.parametrize("name", list(BODIES))
def test_the_pieces_are_model_dump_json(name: str) -> None:
    body = BODIES[name]
    pieces = sliced_json(body)
    assert b"".join(pieces) == body.model_dump_json().encode()
    if weight(body) > SLICE_VALUES:
        assert len(pieces) > 2
        assert max(len(piece) for piece in pieces) < SLICE_VALUES * 40, max(len(piece) for piece in pieces)
    else:
        assert len(pieces) == 1
