"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

The request (text or a list of input items, `instructions`, function
tools, `text.format`, `max_output_tokens`) becomes a chat request, rendered
by the model's template; the output becomes Responses items: a `reasoning`
item (with a reasoning parser), a `message` with one `output_text` part,
and a `function_call` item per tool call. Streams send OpenAI's typed
events (response.created ... response.completed). Nothing is stored: a
request must carry its whole conversation (`previous_response_id` is
refused), as `store: false` asks of OpenAI.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.endpoints.chat import start_chat
from aioserve.server.intake.request_body import parse_body
from aioserve.server.intake.responses_request import ResponsesRequest, chat_request
from aioserve.server.output.assembly import ChoiceUpdate, respond
from aioserve.server.output.completion_bodies import Usage
from aioserve.server.output.generation import Choice
from aioserve.server.output.responses_api_bodies import (
    FunctionToolCall,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputTextContent,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningTextContent,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
)
from aioserve.server.output.tool_parsers.calls import new_call_id
from aioserve.server.wire import WireModel


class Event(WireModel):
    """A stream event: its type, its sequence number and the fields of its
    type, which hold the objects of output/responses_api_bodies.py."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="null")


async def create_response(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, ResponsesRequest)
    ctx.check_generates()
    chat, translation = chat_request(body, takes_images=ctx.images is not None)
    try:
        generation, new_processor = await start_chat(request, ctx, chat, "resp")
    except APIError as exc:  # named as the chat request's fields are; say the input's
        exc.param = translation.param(exc.param)
        raise
    builder = ResponsesBuilder(ctx, body, generation.request_id)
    # include_usage: the usage hook is where the stream's closing events go out.
    return await respond(
        request, generation, builder, stream=body.stream, include_usage=True, new_processor=new_processor
    )


class ResponsesBuilder:
    def __init__(self, ctx: ServingContext, body: ResponsesRequest, request_id: str) -> None:
        self.ctx = ctx
        self.body = body
        self.id = request_id.replace("resp-", "resp_", 1)
        self.created = int(time.time())
        self._sequence = 0
        self._items: list[OutputMessage | FunctionToolCall] = []  # the streamed output items, in order
        self._message: OutputMessage | None = None  # the open message item
        self._calls: dict[int, FunctionToolCall] = {}  # stream index -> function_call item
        self._reasoning = ""
        self._finish: str | None = None

    # -- the response object -------------------------------------------------------

    def _response(self, status: ResponseStatus, output: list[OutputItem], usage: Usage | None) -> ResponseObject:
        body = self.body
        return ResponseObject(
            id=self.id, created_at=self.created, status=status, model=self.ctx.model_name, output=output,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens, temperature=body.temperature,
            top_p=body.top_p, tools=body.tools or [], tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls, text=body.text or {"format": {"type": "text"}},
            metadata=body.metadata or {}, user=body.user,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            usage=_usage(usage) if usage else None,
        )

    def _status(self) -> ResponseStatus:
        return "incomplete" if self._finish == "length" else "completed"

    def whole(self, results: list[ChoiceUpdate], usage: Usage) -> BaseModel:
        (update,) = results  # the Responses API has no n
        self._finish = update.finish_reason
        message = update.message
        output: list[OutputItem] = []
        if message.reasoning_content:
            output.append(_reasoning_item(message.reasoning_content))
        if message.content or not message.tool_calls:
            output.append(_message_item(_item_id("msg"), message.content, "completed"))
        for call in message.tool_calls:
            function = call.get("function", {})
            output.append(_call_item(call.get("id") or new_call_id(), function.get("name", ""),
                                     function.get("arguments", ""), "completed"))
        return self._response(self._status(), output, usage)

    # -- the stream ----------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        event = Event(type=kind, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event

    def opening(self, choices: list[Choice]) -> list[WireModel]:
        started = self._response("in_progress", [], None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def chunk(self, updates: list[ChoiceUpdate]) -> list[WireModel]:
        events: list[WireModel] = []
        for update in updates:
            content = update.content
            self._reasoning += content.reasoning_content
            if content.content:
                events += self._text(content.content)
            for piece in content.tool_calls:
                events += self._call_piece(piece)
            if update.finish_reason:
                self._finish = update.finish_reason
        return events

    def _text(self, text: str) -> list[WireModel]:
        """An event's item or part is a copy where the stream goes on
        filling the original (the event tells of it as it was then)."""
        events: list[WireModel] = []
        if self._message is None:
            self._message = _message_item(_item_id("msg"), "", "in_progress")
            self._items.append(self._message)
            index = len(self._items) - 1
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=self._message.model_copy(update={"content": []})))
            events.append(self._event("response.content_part.added", item_id=self._message.id,
                                      output_index=index, content_index=0, part=OutputTextContent(text="")))
        self._message.content[0].text += text
        events.append(self._event("response.output_text.delta", item_id=self._message.id,
                                  output_index=self._items.index(self._message), content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _call_piece(self, piece: dict[str, Any]) -> list[WireModel]:
        function = piece.get("function", {})
        call = self._calls.get(piece.get("index", 0))
        events: list[WireModel] = []
        if call is None:
            call = _call_item(piece.get("id") or new_call_id(), function.get("name", ""), "", "in_progress")
            self._calls[piece.get("index", 0)] = call
            self._items.append(call)
            events.append(self._event("response.output_item.added", output_index=len(self._items) - 1,
                                      item=call.model_copy()))
        if function.get("arguments"):
            call.arguments += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=call.id,
                                      output_index=self._items.index(call), delta=function["arguments"]))
        return events

    def usage_chunk(self, usage: Usage) -> list[WireModel]:
        """The stream's end: each item closed, then response.completed with the usage."""
        events: list[WireModel] = []
        for index, item in enumerate(self._items):
            item.status = "completed"
            if isinstance(item, OutputMessage):
                part = item.content[0]
                events.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                          content_index=0, text=part.text, logprobs=[]))
                events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                          content_index=0, part=part))
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                          output_index=index, arguments=item.arguments))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        output: list[OutputItem] = [_reasoning_item(self._reasoning)] if self._reasoning else []
        output += self._items
        final = "response.incomplete" if self._status() == "incomplete" else "response.completed"
        events.append(self._event(final, response=self._response(self._status(), output, usage)))
        return events


def _item_id(prefix: str) -> str:
    return f"{prefix}_{new_call_id().removeprefix('call_')}"


def _message_item(item_id: str, text: str, status: ItemStatus) -> OutputMessage:
    return OutputMessage(id=item_id, status=status, content=[OutputTextContent(text=text)])


def _call_item(call_id: str, name: str, arguments: str, status: ItemStatus) -> FunctionToolCall:
    return FunctionToolCall(id=_item_id("fc"), call_id=call_id, name=name, arguments=arguments, status=status)


def _reasoning_item(text: str) -> ReasoningItem:
    return ReasoningItem(id=_item_id("rs"), content=[ReasoningTextContent(text=text)], status="completed")


def _usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=usage.total_tokens,
    )
