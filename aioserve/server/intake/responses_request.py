"""The request body of POST /v1/responses (OpenAI's Responses API), and
its translation into a chat request: the input items become chat messages
(function calls and their outputs included), `text.format` becomes
`response_format`, function tools become chat tools. `input_image` parts
become chat's image_url parts when the model takes images (a part keeps
its number, so an error the chat request names is renamed to the input
item's: ChatTranslation.param). Nothing is stored, so
`previous_response_id` and an image's `file_id` are refused."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, ValidationError

from aioserve.sampling_limits import OPENAI_BOUNDS
from aioserve.server.errors import APIError, from_validation_error
from aioserve.server.intake.openai_requests import ChatCompletionRequest
from aioserve.server.intake.request_model import RequestModel, bounded

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = bounded(None, OPENAI_BOUNDS["temperature"])
    top_p: float | None = bounded(None, OPENAI_BOUNDS["top_p"])
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError("content must be a string or a list of parts", param=f"{where}.content")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(
                f"this model takes text only: a part of type {kind!r} is not supported", param=f"{where}.content.{number}"
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _parts_of(content: Any, where: str, takes_images: bool) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text, or, holding an
    image for a model that takes them, chat's parts one for one."""
    if not takes_images or not isinstance(content, list) or not any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    ):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(
                    "an input_image part needs its image_url (a URL or a data URL; file_id is not supported: "
                    "this server stores no files)", param=f"{where}.content.{number}.image_url",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise APIError(f"a part of type {kind!r} is not supported", param=f"{where}.content.{number}")
    return parts


@dataclass
class ChatTranslation:
    """Where each chat message came from: chat's parameter names renamed to the input's."""

    messages: list[dict[str, Any]]
    sources: dict[int, str] = field(default_factory=dict)  # chat message index -> "input.N"

    def param(self, param: str | None) -> str | None:
        found = re.fullmatch(r"messages\.(\d+)(.*)", param or "")
        if found is None or int(found[1]) not in self.sources:
            return param
        return self.sources[int(found[1])] + found[2]


def chat_messages(body: ResponsesRequest, takes_images: bool = False) -> ChatTranslation:
    """Input items -> chat messages (function calls and their outputs included)."""
    messages: list[dict[str, Any]] = []
    translation = ChatTranslation(messages)
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for number, item in enumerate(items):
        where = f"input.{number}"
        kind = item.get("type", "message")
        if kind == "message":
            translation.sources[len(messages)] = where
            messages.append({"role": item.get("role", "user"),
                             "content": _parts_of(item.get("content", ""), where, takes_images)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue  # an earlier turn's thought: templates drop it
        else:
            raise APIError(f"input items of type {kind!r} are not supported", param=f"{where}.type")
    return translation


def chat_request(body: ResponsesRequest, takes_images: bool = False) -> tuple[ChatCompletionRequest, ChatTranslation]:
    """The chat request, and how its parameter names map back to the input's.
    `takes_images`: the model is a vision-language model (else an
    input_image part is refused as before)."""
    if body.previous_response_id is not None:
        raise APIError(
            "previous_response_id is not supported: this server stores no responses; send the conversation in input",
            param="previous_response_id",
        )
    translation = chat_messages(body, takes_images)
    fields: dict[str, Any] = {
        "model": body.model, "messages": translation.messages, "stream": body.stream,
        "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
    }
    tools = []
    for number, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise APIError(f"tools of type {tool.get('type')!r} are not supported (only function tools)",
                           param=f"tools.{number}.type")
        tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }})
    if tools:
        fields["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fields["tool_choice"] = choice
    text_format = (body.text or {}).get("format")
    if text_format is not None and not isinstance(text_format, dict):
        raise APIError("text.format must be an object, e.g. {\"type\": \"json_schema\", ...}", param="text.format")
    if text_format:
        kind = text_format.get("type")
        if kind == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": text_format.get("name"), "schema": text_format.get("schema"), "strict": text_format.get("strict"),
            }}
        elif kind in ("json_object", "text"):
            fields["response_format"] = {"type": kind}
        else:
            raise APIError(f"text.format type {kind!r} is not supported", param="text.format.type")
    try:
        return ChatCompletionRequest.model_validate(fields), translation
    except ValidationError as exc:
        error = from_validation_error(exc)
        error.param = translation.param(error.param)
        raise error from None
