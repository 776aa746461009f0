"""The objects of POST /v1/responses (OpenAI's Responses API): the response,
its output items (a `message` with one `output_text` part, a `function_call`
per tool call, a `reasoning` item) and its usage, named and shaped as
OpenAI's spec has them (tests/test_responses_api.py checks them against
it), so that /openapi.json describes them. The stream's events
(endpoints/responses_api.py) carry these objects inside them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from aioserve.server.wire import WireModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextContent(WireModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = []  # never any: no citations, no files
    logprobs: list[dict[str, Any]] = []  # never any: the Responses API here takes no logprobs request


class OutputMessage(WireModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextContent]  # one part, which a stream fills as the text comes


class FunctionToolCall(WireModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str  # what the function's output names when it is sent back as input
    name: str
    arguments: str  # JSON text, which a stream fills as it comes
    status: ItemStatus


class ReasoningTextContent(WireModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(WireModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = []  # never any: the thought is given whole, in content
    content: list[ReasoningTextContent]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionToolCall | ReasoningItem, Field(discriminator="type")]


class InputTokensDetails(WireModel):
    cached_tokens: int


class OutputTokensDetails(WireModel):
    reasoning_tokens: int


class ResponseUsage(WireModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(WireModel):
    reason: Literal["max_output_tokens"]


# OpenAI's `Response`, under that name in the OpenAPI document (openapi/schemas.py).
class ResponseObject(WireModel):
    """What POST /v1/responses answers, and what a stream's first and last
    events carry. The request's settings come back as given; nothing is
    stored, so `store` is false and `previous_response_id` null."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: str | None = None
    metadata: dict[str, str]
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    error: dict[str, Any] | None = None
    user: str | None
    incomplete_details: IncompleteDetails | None
    usage: ResponseUsage | None
