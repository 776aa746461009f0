"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, possibly after some text (which stays content).

Streaming holds back only what may be a tag (a partial `<tool_call>`) and a
call until its closing tag; each call then goes out as one chunk. A block
whose JSON is not a call is shown as the text it was.
"""

from __future__ import annotations

import json
from typing import Any

from aioserve.server.content import ContentDelta
from aioserve.server.tool_parsers.calls import call_chunk, parse_call
from aioserve.server.tool_parsers.json_scan import partial_suffix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._calls = 0
        self._gap = ""  # whitespace after a call: dropped unless text follows

    def feed(self, text: str) -> ContentDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        delta = self._drain(final=True)
        return delta, "tool_calls" if self._calls and finish_reason == "stop" else finish_reason

    def _drain(self, final: bool) -> ContentDelta:
        out = ContentDelta()
        while True:
            if not self._in_call:
                start = self._buffer.find(START)
                if start < 0:
                    keep = 0 if final else partial_suffix(self._buffer, START)
                    self._content(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                self._content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(START) :]
                self._in_call = True
            end = self._buffer.find(END)
            if end < 0 and not final:
                return out
            body = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(END) :]
            self._in_call = False
            call = parse_call(body.strip())
            if call is None:
                self._content(out, START + body + (END if end >= 0 else ""))
            else:
                out.tool_calls.append(call_chunk(self._calls, call))
                self._calls += 1
                self._gap = ""
            if end < 0:
                return out

    def _content(self, out: ContentDelta, text: str) -> None:
        if not self._calls:
            out.content += text
            return
        if not text.strip():
            self._gap += text
            return
        out.content += self._gap + text
        self._gap = ""


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """For a chat template that ignores `tools`: the instructions Qwen's own template writes."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    )


def render_call(name: str, arguments: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n</tool_call>'
