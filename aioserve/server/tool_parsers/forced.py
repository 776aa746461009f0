"""Tool calls whose shape a grammar forces (tool_choice "required" or a
named function), read straight from the JSON the grammar produced rather
than from the model's own call format.

* named: the output *is* the arguments object; it streams as argument
  pieces of one call;
* required: the output is `[{"name": ..., "parameters": {...}}, ...]`; each
  call goes out as one chunk when its object closes.
"""

from __future__ import annotations

from typing import Any

from aioserve.server.content import ContentDelta
from aioserve.server.tool_parsers.calls import ParsedCall, call_chunk, new_call_id, parse_call
from aioserve.server.tool_parsers.json_scan import JsonObjectReader


def named_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


def required_schema(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """A non-empty array of calls to the given functions (one at most without parallel calls)."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": named_schema(parameters)},
                "required": ["name", "parameters"],
            }
            for name, parameters in functions
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedCall:
    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> ContentDelta:
        if not text:
            return ContentDelta()
        return self._piece(text)

    def _piece(self, text: str) -> ContentDelta:
        if not self._started:
            self._started = True
            header = {"index": 0, "id": new_call_id(), "type": "function", "function": {"name": self.name, "arguments": text}}
            return ContentDelta(tool_calls=[header])
        return ContentDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}])

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        delta = ContentDelta()
        if not self._started:  # nothing generated (max_tokens reached at once): still one call
            delta = self._piece("")
        return delta, "tool_calls" if finish_reason == "stop" else finish_reason


class RequiredCalls:
    def __init__(self) -> None:
        self._buffer = ""
        self._reader: JsonObjectReader | None = None  # the call being read
        self._calls = 0

    def feed(self, text: str) -> ContentDelta:
        out = ContentDelta()
        self._buffer += text
        while self._buffer:
            if self._reader is None:
                start = self._buffer.find("{")
                if start < 0:
                    self._buffer = ""  # "[", ",", "]" and whitespace between calls
                    break
                self._buffer = self._buffer[start:]
                self._reader = JsonObjectReader()
            text_of_call, self._buffer = self._reader.feed(self._buffer)
            if text_of_call is None:
                break
            self._reader = None
            call = parse_call(text_of_call)
            if call is not None:
                out.tool_calls.append(call_chunk(self._calls, call))
                self._calls += 1
        return out

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        return ContentDelta(), "tool_calls" if self._calls and finish_reason == "stop" else finish_reason


__all__ = ["NamedCall", "ParsedCall", "RequiredCalls", "named_schema", "required_schema"]
