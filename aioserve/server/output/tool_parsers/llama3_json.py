"""Llama 3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
(several calls separated by `;`), optionally after `<|python_tag|>`.

An output that does not begin with `{` is plain content. For a whole
response calls go out one chunk each once their object closes; an object
that is not a call turns the rest of the output back into content, as
written. In a stream (`stream_arguments`) a call's id and name go out first
and its arguments in pieces as they are written (streamed_call.py).
"""

from __future__ import annotations

import json
from typing import Any

from aioserve.server.output.content import ContentDelta
from aioserve.server.output.tool_parsers.calls import call_chunk, parse_call
from aioserve.server.output.tool_parsers.json_scan import JsonObjectReader
from aioserve.server.output.tool_parsers.streamed_call import StreamedJsonCall

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    def __init__(self, stream_arguments: bool = False) -> None:
        self._stream_arguments = stream_arguments
        self._buffer = ""
        self._mode = "undecided"  # undecided | calls | text
        self._reader: JsonObjectReader | StreamedJsonCall | None = None  # the call being read
        self._calls = 0

    def feed(self, text: str) -> ContentDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        delta = self._drain(final=True)
        unstreamed = not isinstance(self._reader, StreamedJsonCall) or not self._reader.committed
        if self._mode == "calls" and self._reader is not None and unstreamed:
            delta.content += self._reader.text  # an unfinished call is shown as written
        return delta, "tool_calls" if self._calls and finish_reason == "stop" else finish_reason

    def _drain(self, final: bool) -> ContentDelta:
        out = ContentDelta()
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG) :].lstrip()
            if not head and not final:
                return out
            if (PYTHON_TAG.startswith(head) and head and not final):
                return out
            self._mode = "calls" if head.startswith("{") else "text"
            if self._mode == "calls":
                self._buffer = head
        if self._mode == "text":
            out.content, self._buffer = self._buffer, ""
            return out
        while self._buffer:
            if self._reader is None:
                rest = self._buffer.lstrip().lstrip(";").lstrip()
                if not rest:
                    self._buffer = ""
                    break
                if not rest.startswith("{"):
                    self._mode = "text"
                    out.content, self._buffer = rest, ""
                    break
                self._buffer = rest
                self._reader = StreamedJsonCall(self._calls) if self._stream_arguments else JsonObjectReader()
            if isinstance(self._reader, StreamedJsonCall):
                step = self._reader.feed(self._buffer)
                self._buffer = step.rest
                out.tool_calls.extend(step.chunks)
                if not step.closed:
                    break
                written = self._reader.text
                self._reader = None
                if step.not_a_call:
                    self._mode = "text"
                    out.content, self._buffer = written + self._buffer, ""
                    break
                self._calls += 1
                continue
            text, self._buffer = self._reader.feed(self._buffer)
            if text is None:
                break
            self._reader = None
            call = parse_call(text)
            if call is None:
                self._mode = "text"
                out.content, self._buffer = text + self._buffer, ""
                break
            out.tool_calls.append(call_chunk(self._calls, call))
            self._calls += 1
        return out


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """For a chat template that ignores `tools` (Llama 3.0's): the JSON
    instructions of Llama 3.1's template."""
    listing = "\n\n".join(json.dumps(tool, indent=4, ensure_ascii=False) for tool in tools)
    return (
        "Given the following functions, please respond with a JSON for a function call with its proper "
        'arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
        '"parameters": dictionary of argument name and its value}. Do not use variables.\n\n' + listing
    )


def render_call(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
