"""Tool calls whose shape a grammar forces (tool_choice "required" or a
named function), read straight from the JSON the grammar produced rather
than from the model's own call format.

* named: the output *is* the arguments object; it streams as argument
  pieces of one call;
* required: the output is `[{"name": ..., "parameters": {...}}, ...]`; each
  call streams alike: its header once its name is read, then argument pieces.
"""

from __future__ import annotations

from typing import Any

from aioserve.server.output.content import ContentDelta
from aioserve.server.output.tool_parsers.calls import ParsedCall, new_call_id
from aioserve.server.output.tool_parsers.streamed_call import StreamedJsonCall


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
    """The forced array of calls, each streamed as the model writes it: its
    header once the name is read, then its arguments in pieces (as a named
    choice streams, and as OpenAI and vLLM stream both)."""

    def __init__(self) -> None:
        self._call: StreamedJsonCall | None = None  # the call being read
        self._calls = 0  # calls closed
        self._open_committed = False  # the open call's header went out

    def feed(self, text: str) -> ContentDelta:
        out = ContentDelta()
        while text:
            if self._call is None:
                start = text.find("{")
                if start < 0:
                    break  # "[", ",", "]" and whitespace between calls
                text = text[start:]
                self._call = StreamedJsonCall(self._calls)
            step = self._call.feed(text)
            out.tool_calls.extend(step.chunks)
            self._open_committed = self._call.committed
            if not step.closed:
                break
            if not step.not_a_call:
                self._calls += 1
            self._call, self._open_committed, text = None, False, step.rest
        return out

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        went_out = self._calls or self._open_committed
        return ContentDelta(), "tool_calls" if went_out and finish_reason == "stop" else finish_reason


__all__ = ["NamedCall", "ParsedCall", "RequiredCalls", "named_schema", "required_schema"]
