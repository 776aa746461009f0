"""Pythonic tool calls (Llama 3.2 and Llama 4): the output is a Python list
of calls, `[get_weather(city="Paris", days=3), other()]`, in Llama 4 between
`<|python_start|>` and `<|python_end|>`.

An output that does not begin with `[` is plain content. Each call's id and
name go out when its `name(` is read; each keyword argument goes out as JSON
text (`{"city": "Paris"`, `, "days": 3`) once its value ends, and `}` with
the closing parenthesis, so a client sees the arguments grow. Values are
Python literals, read with ast.literal_eval (a value that is none, such as a
variable's name, is passed on as its text).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from aioserve.server.output.content import ContentDelta
from aioserve.server.output.tool_parsers.calls import arguments_object
from aioserve.server.output.tool_parsers.streamed_call import arguments_chunk, header_chunk

START, END = "<|python_start|>", "<|python_end|>"
CALL_HEAD = re.compile(r"\s*,?\s*([A-Za-z_][\w.]*)\s*\(")
QUOTES = "'\""


class PythonicToolParser:
    def __init__(self, stream_arguments: bool = True) -> None:
        self._buffer = ""
        self._state = "undecided"  # undecided | between | call | text | done
        self._calls = 0
        self._arguments = 0  # of the current call, gone out
        self._argument = ""  # the current argument's text so far
        self._depth = 0
        self._quote = ""
        self._escape = False

    def feed(self, text: str) -> ContentDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        delta = self._drain(final=True)
        if self._state in ("undecided", "text"):
            delta.content += self._buffer
        return delta, "tool_calls" if self._calls and finish_reason == "stop" else finish_reason

    def _drain(self, final: bool) -> ContentDelta:
        out = ContentDelta()
        if self._state == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(START):
                head = head[len(START) :].lstrip()
            if not final and (not head or (START.startswith(head))):
                return out
            if not head.startswith("["):
                self._state = "text"
            else:
                self._state, self._buffer = "between", head[1:]
        if self._state == "text":
            out.content, self._buffer = self._buffer, ""
            return out
        while self._buffer and self._state in ("between", "call"):
            if self._state == "call":
                self._in_call(out)
            elif not self._between(out):
                break
        if self._state == "done":
            self._buffer = ""
        return out

    def _between(self, out: ContentDelta) -> bool:
        """The next call's head; False while it is not all here."""
        head = self._buffer.lstrip().lstrip(",").lstrip()
        if head.startswith("]"):
            self._state, self._buffer = "done", ""
            return True
        match = CALL_HEAD.match(head)
        if match is None:
            self._buffer = head
            if head and not re.fullmatch(r"[A-Za-z_][\w.]*\s*", head):
                self._state = "done"  # no call: the list is over
            return False
        out.tool_calls.append(header_chunk(self._calls, match.group(1)))
        self._buffer, self._state, self._arguments, self._argument = head[match.end() :], "call", 0, ""
        return True

    def _in_call(self, out: ContentDelta) -> None:
        for i, ch in enumerate(self._buffer):
            if self._quote:
                self._argument += ch
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == self._quote:
                    self._quote = ""
                continue
            if ch in QUOTES:
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}" and self._depth:
                self._depth -= 1
            elif ch in ",)" and not self._depth:
                self._emit_argument(out)
                if ch == ")":
                    out.tool_calls.append(arguments_chunk(self._calls, "}" if self._arguments else "{}"))
                    self._calls += 1
                    self._buffer, self._state = self._buffer[i + 1 :], "between"
                    return
                continue
            self._argument += ch
        self._buffer = ""

    def _emit_argument(self, out: ContentDelta) -> None:
        text, self._argument = self._argument.strip(), ""
        if not text:
            return
        key, _, value = text.partition("=")
        try:
            parsed: Any = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed = value.strip()
        piece = ("{" if not self._arguments else ", ") + f"{json.dumps(key.strip())}: {json.dumps(parsed, ensure_ascii=False)}"
        out.tool_calls.append(arguments_chunk(self._calls, piece))
        self._arguments += 1


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """For a chat template that ignores `tools`: Llama 3.2's pythonic instructions."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You are an expert in composing functions. If you decide to invoke any of the function(s), you MUST put it "
        "in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]. "
        "You SHOULD NOT include any other text in the response if you call a function.\n\n"
        f"Here is a list of functions in JSON format that you can invoke.\n{listing}"
    )


def render_call(name: str, arguments: Any) -> str:
    listed = ", ".join(f"{key}={value!r}" for key, value in arguments_object(arguments).items())
    return f"[{name}({listed})]"
