"""The bodies of /v1/completions and /v1/chat/completions: whole responses,
their stream chunks, usage and logprobs, shaped as OpenAI's published spec
has them (tests/test_openapi_spec.py checks every body against it). The
other endpoints' bodies: service_bodies.py, generate_bodies.py,
responses_api_bodies.py; errors: server/errors.py."""

from __future__ import annotations

from typing import Any, Literal

from aioserve.server.wire import WireModel

# Ours are stop | length | abort | error; OpenAI's spec adds tool_calls and
# content_filter, which a content processor may report.
FinishReason = str


def openai_finish_reason(reason: str | None) -> FinishReason | None:
    """OpenAI's set has no "abort": a request cut short (the drain's timeout on
    shutdown, an abort) reports "length", as a truncated output does, which
    every client accepts and treats as incomplete. ("error" is followed by an
    error event or answered with an error body.) SGLang's /generate keeps "abort"."""
    return "length" if reason == "abort" else reason


class PromptTokensDetails(WireModel):
    cached_tokens: int


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# -- /v1/completions ------------------------------------------------------------


class CompletionLogprobs(WireModel):
    """The legacy shape; `text_offset` indexes the choice's text (for a
    stream, the text of all its chunks joined)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token of an echo
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# vLLM's prompt_logprobs: None for the first prompt token, then for each
# token {token id: {"logprob", "rank", "decoded_token"}}, the prompt's own
# token and the N likeliest (server/output/prompt_logprobs.py).
PromptLogprobsList = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(WireModel):
    """`stop_reason` (vLLM's): the stop string or stop token id that ended
    the choice; null when EOS, the length or an abort did."""

    omit_when_none = ("prompt_logprobs",)

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class Completion(WireModel):
    """A whole response, and (the same shape) each stream chunk; the last
    chunk of a stream with include_usage has no choices and the usage."""

    omit_when_none = ("usage",)

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions --------------------------------------------------------


class TopLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(WireModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatMessage(WireModel):
    """`reasoning_content` and `tool_calls` come only from a content processor
    that produces them (vLLM and SGLang name the reasoning field this way)."""

    omit_when_none = ("reasoning_content", "tool_calls")

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(WireModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletion(WireModel):
    """`prompt_logprobs` (vLLM's): of the rendered prompt, one list for all choices."""

    omit_when_none = ("prompt_logprobs",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsList | None = None


class ChatDelta(WireModel):
    omit_when_none = ("role", "content", "reasoning_content", "tool_calls")

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(WireModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(WireModel):
    omit_when_none = ("usage",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
