"""OpenAI response bodies: completions, chat completions, their stream
chunks, usage, logprobs, models and errors, shaped as OpenAI's published
spec has them (tests/test_openapi_spec.py checks every body against it)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, create_model

from aioserve.scheduler import SchedulerInfo
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


# -- /v1/models ------------------------------------------------------------------


class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str  # vLLM's extras: where the weights came from, and the context length
    max_model_len: int


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors ----------------------------------------------------------------------


class ErrorDetail(WireModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(WireModel):
    error: ErrorDetail


# -- the small endpoints (model_routes, token_routes, ops_routes) ------------------------------------------------


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class FlushCacheResponse(BaseModel):
    flushed: bool


class TensorParallelInfo(BaseModel):
    tp_size: int
    nnodes: int
    ranks: list[dict[str, Any]]  # per rank: heads, KV heads, MLP columns, vocab rows, KV pool


class ServerConfigInfo(BaseModel):
    """What /server_info tells of the configuration."""

    model: str
    max_model_len: int
    overlap: bool
    cache: str
    tensor_parallel: TensorParallelInfo
    # The model's sampling defaults a request's unset fields take (--generation-config).
    generation_defaults: dict[str, Any] = {}
    # SGLang's names for what a router reads when a worker registers
    # (server/endpoints/worker_routes.py): its served name, model and sizes.
    served_model_name: str
    model_path: str
    tp_size: int
    dp_size: int  # replicas inside this server: always 1 (--dp runs each as a server of its own)
    max_running_requests: int
    version: str


def _scheduler_info_fields() -> dict[str, Any]:
    hints = typing.get_type_hints(SchedulerInfo)
    return {field.name: (hints[field.name], ...) for field in dataclasses.fields(SchedulerInfo)}


# GET /server_info: the configuration and the scheduler's snapshot, flattened.
# The snapshot's fields are SchedulerInfo's own (scheduler/client.py), read
# from the dataclass, so a counter added there reaches /server_info and the
# OpenAPI document with no copy kept here.
ServerInfo = create_model(
    "ServerInfo", __base__=ServerConfigInfo, __doc__="GET /server_info", **_scheduler_info_fields()
)
