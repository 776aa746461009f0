"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, possibly after some text (which stays content).

Streaming holds back only what may be a tag (a partial `<tool_call>`). In a
stream (`stream_arguments`) a call goes out as OpenAI streams one: its id and
name first, then its arguments in pieces as they are written
(streamed_call.py); for a whole response a call is read to its closing tag
and checked, and a block whose JSON is not a call is shown as the text it was.
"""

from __future__ import annotations

import json
from typing import Any

from aioserve.server.output.content import ContentDelta
from aioserve.server.output.tool_parsers.calls import call_chunk, parse_call
from aioserve.server.output.tool_parsers.json_scan import partial_suffix
from aioserve.server.output.tool_parsers.streamed_call import StreamedJsonCall

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def __init__(self, stream_arguments: bool = False) -> None:
        self._stream_arguments = stream_arguments
        self._buffer = ""
        self._in_call = False
        self._streamed: StreamedJsonCall | None = None  # the call being streamed
        self._calls = 0
        self._gap = ""  # whitespace after a call: dropped unless text follows
        self._closing_tag_due = False  # a streamed call ended at its JSON: `</tool_call>` comes next

    def feed(self, text: str) -> ContentDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        delta = self._drain(final=True)
        if self._streamed is not None and not self._streamed.committed:
            self._content(delta, START + self._streamed.text)  # an unfinished block, as written
        return delta, "tool_calls" if self._calls and finish_reason == "stop" else finish_reason

    def _drain(self, final: bool) -> ContentDelta:
        out = ContentDelta()
        while True:
            if self._closing_tag_due and not self._drop_closing_tag(final):
                return out
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
                if self._stream_arguments:
                    self._streamed = StreamedJsonCall(self._calls)
            if self._streamed is not None:
                if not self._streamed_step(out):
                    return out
                continue
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
                self._called()
            if end < 0:
                return out

    def _streamed_step(self, out: ContentDelta) -> bool:
        """Feed the buffer to the streamed call; True when the block is done
        (the buffer then holds what follows it)."""
        streamed = self._streamed
        assert streamed is not None
        text, self._buffer = self._buffer, ""
        whole = streamed.text + text
        cut = -1 if streamed.committed else whole.find(END)
        if cut >= 0:
            # A closing tag before any call began: the JSON must close before it.
            before = max(cut - len(streamed.text), 0)
            step = streamed.feed(text[:before])
            if not step.closed and not streamed.committed:
                self._content(out, START + whole[: cut + len(END)])  # not a call: shown as written
                self._buffer, self._streamed, self._in_call = whole[cut + len(END) :], None, False
                return True
            if step.closed:
                step.rest += text[before:]
            else:
                later = streamed.feed(text[before:])
                later.chunks[:0] = step.chunks
                step = later
        else:
            step = streamed.feed(text)
        out.tool_calls.extend(step.chunks)
        if not step.closed:
            return False
        rest = step.rest
        if step.not_a_call:
            end = rest.find(END)
            shown = rest if end < 0 else rest[: end + len(END)]
            self._content(out, START + streamed.text + shown)
            rest = "" if end < 0 else rest[end + len(END) :]
        else:
            self._called()
            self._closing_tag_due = True
        self._buffer, self._streamed, self._in_call = rest, None, False
        return True

    def _drop_closing_tag(self, final: bool) -> bool:
        """After a streamed call: its closing tag (and the space before it)
        is no content. False while what came so far may still be that tag."""
        head = self._buffer.lstrip()
        if head.startswith(END):
            self._gap += self._buffer[: len(self._buffer) - len(head)]
            self._buffer, self._closing_tag_due = head[len(END) :], False
        elif END.startswith(head) and not final:
            return False
        else:
            self._closing_tag_due = False
        return True

    def _called(self) -> None:
        self._calls += 1
        self._gap = ""

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
