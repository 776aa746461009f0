"""Mistral tool calls, after the `[TOOL_CALLS]` token, in either of the two
forms Mistral's tokenizers teach:

- v0.3 (Mistral 7B v0.3, Nemo): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`
- v11+ (Small 3.1+, Magistral): `[TOOL_CALLS]name[ARGS]{...}` per call
  (`[CALL_ID]id` may sit between name and `[ARGS]`)

Text before the first `[TOOL_CALLS]` is content. Each call's id and name go
out first, then its arguments in pieces as they are written. `[TOOL_CALLS]`
is a special token: the tool plan keeps special tokens in the output text
for this format (ToolFormat.keeps_special_tokens).
"""

from __future__ import annotations

import json
from typing import Any

from aioserve.server.output.content import ContentDelta
from aioserve.server.output.tool_parsers.json_scan import JsonEndScanner, partial_suffix
from aioserve.server.output.tool_parsers.streamed_call import StreamedJsonCall, arguments_chunk, header_chunk

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralToolParser:
    def __init__(self, stream_arguments: bool = True) -> None:
        self._buffer = ""
        # content | decide (after [TOOL_CALLS]) | array | name | arguments | done
        self._state = "content"
        self._calls = 0
        self._call: StreamedJsonCall | None = None  # v0.3: the array's current call
        self._scanner: JsonEndScanner | None = None  # v11: where the current call's arguments end

    def feed(self, text: str) -> ContentDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        delta = self._drain(final=True)
        if self._state in ("content", "decide", "name") and self._buffer:
            delta.content += self._buffer  # no call came of it: shown as written
            self._buffer = ""
        return delta, "tool_calls" if self._calls and finish_reason == "stop" else finish_reason

    def _drain(self, final: bool) -> ContentDelta:
        out = ContentDelta()
        while True:
            before = (self._state, self._buffer)
            getattr(self, f"_{self._state}")(out, final)
            if (self._state, self._buffer) == before:
                return out

    def _content(self, out: ContentDelta, final: bool) -> None:
        start = self._buffer.find(TOOL_CALLS)
        if start < 0:
            keep = 0 if final else partial_suffix(self._buffer, TOOL_CALLS)
            self._text(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return
        self._text(out, self._buffer[:start])
        self._buffer, self._state = self._buffer[start + len(TOOL_CALLS) :], "decide"

    def _text(self, out: ContentDelta, text: str) -> None:
        if text.strip() or not self._calls:  # the space between calls is no content
            out.content += text

    def _decide(self, out: ContentDelta, final: bool) -> None:
        head = self._buffer.lstrip()
        if not head:
            return
        if head.startswith("["):
            self._buffer, self._state = head[1:], "array"
        else:
            self._buffer, self._state = head, "name"

    def _array(self, out: ContentDelta, final: bool) -> None:
        if self._call is None:
            head = self._buffer.lstrip().lstrip(",").lstrip()
            if head.startswith("]"):
                self._buffer, self._state = head[1:], "done"
                return
            if not head.startswith("{"):
                self._buffer = head
                return
            self._buffer, self._call = head, StreamedJsonCall(self._calls)
        step = self._call.feed(self._buffer)
        out.tool_calls.extend(step.chunks)
        self._buffer = step.rest
        if step.closed:
            self._call = None
            if not step.not_a_call:
                self._calls += 1

    def _name(self, out: ContentDelta, final: bool) -> None:
        marks = [i for i in (self._buffer.find(ARGS), self._buffer.find(CALL_ID)) if i >= 0]
        if not marks:
            return
        name = self._buffer[: min(marks)].strip()
        rest = self._buffer[min(marks) :]
        if rest.startswith(CALL_ID):
            at = rest.find(ARGS)
            if at < 0:
                return
            rest = rest[at:]
        out.tool_calls.append(header_chunk(self._calls, name))
        self._buffer, self._state, self._scanner = rest[len(ARGS) :], "arguments", JsonEndScanner()

    def _arguments(self, out: ContentDelta, final: bool) -> None:
        assert self._scanner is not None
        if not self._buffer:
            return
        end = self._scanner.feed(self._buffer)
        piece = self._buffer if end is None else self._buffer[:end]
        out.tool_calls.append(arguments_chunk(self._calls, piece))
        self._buffer = "" if end is None else self._buffer[end:]
        if end is not None:
            self._calls += 1
            self._state, self._scanner = "content", None

    def _done(self, out: ContentDelta, final: bool) -> None:
        self._buffer = ""  # after the calls: nothing (the EOS follows)


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """For a chat template that ignores `tools`: Mistral's own listing."""
    return "[AVAILABLE_TOOLS]" + json.dumps(tools, ensure_ascii=False) + "[/AVAILABLE_TOOLS]"


def render_call(name: str, arguments: Any) -> str:
    return TOOL_CALLS + json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)
