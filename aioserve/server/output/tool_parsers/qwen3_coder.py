"""Qwen3-Coder's XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Text before a call is content. The call's id and name go out when
`<function=NAME>` is read, and each parameter as JSON text (`{"city":
"Paris"`, `, "days": 3`) once its `</parameter>` is, `}` with `</function>`.
Values are raw text: a parameter the tool's schema types as a string stays
one; any other is read as JSON when it parses (a number, an object), else
kept as text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aioserve.server.output.content import ContentDelta
from aioserve.server.output.tool_parsers.calls import arguments_object
from aioserve.server.output.tool_parsers.json_scan import partial_suffix
from aioserve.server.output.tool_parsers.streamed_call import arguments_chunk, header_chunk

START, END = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
PARAMETER_END, FUNCTION_END = "</parameter>", "</function>"


class Qwen3CoderToolParser:
    def __init__(self, tools: list[dict[str, Any]] | None = None, stream_arguments: bool = True) -> None:
        self._types = {
            tool["function"]["name"]: {
                key: (spec or {}).get("type")
                for key, spec in ((tool["function"].get("parameters") or {}).get("properties") or {}).items()
            }
            for tool in tools or []
            if tool.get("function")
        }
        self._buffer = ""
        self._state = "content"  # content | function | parameters | value | closing
        self._calls = 0
        self._name = ""
        self._parameter = ""
        self._given = 0  # parameters of the current call gone out

    def feed(self, text: str) -> ContentDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        delta = self._drain(final=True)
        if self._state == "content":
            delta.content += self._buffer
        elif self._state == "function":
            delta.content += START + self._buffer  # no call came of it: shown as written
        return delta, "tool_calls" if self._calls and finish_reason == "stop" else finish_reason

    def _drain(self, final: bool) -> ContentDelta:
        out = ContentDelta()
        while getattr(self, f"_{self._state}")(out, final):
            pass
        return out

    def _content(self, out: ContentDelta, final: bool) -> bool:
        start = self._buffer.find(START)
        if start < 0:
            keep = 0 if final else partial_suffix(self._buffer, START)
            self._text(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._text(out, self._buffer[:start])
        self._buffer, self._state = self._buffer[start + len(START) :], "function"
        return True

    def _text(self, out: ContentDelta, text: str) -> None:
        if text.strip() or not self._calls:  # the space between calls is no content
            out.content += text

    def _function(self, out: ContentDelta, final: bool) -> bool:
        match = FUNCTION.match(self._buffer)
        if match is None:
            if self._buffer.lstrip() and not "<function=".startswith(self._buffer.lstrip()[:10]):
                out.content += START + self._buffer  # not this format: shown as written
                self._buffer, self._state = "", "content"
            return False
        self._name = match.group(1).strip()
        out.tool_calls.append(header_chunk(self._calls, self._name))
        self._buffer, self._state, self._given = self._buffer[match.end() :], "parameters", 0
        return True

    def _parameters(self, out: ContentDelta, final: bool) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(FUNCTION_END):
            out.tool_calls.append(arguments_chunk(self._calls, "}" if self._given else "{}"))
            self._calls += 1
            self._buffer, self._state = head[len(FUNCTION_END) :], "closing"
            return True
        match = PARAMETER.match(self._buffer)
        if match is None:
            return False
        self._parameter = match.group(1).strip()
        self._buffer, self._state = self._buffer[match.end() :], "value"
        return True

    def _value(self, out: ContentDelta, final: bool) -> bool:
        end = self._buffer.find(PARAMETER_END)
        if end < 0:
            return False
        raw = self._buffer[:end]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = self._typed(raw)
        piece = ("{" if not self._given else ", ") + f"{json.dumps(self._parameter)}: {json.dumps(value, ensure_ascii=False)}"
        out.tool_calls.append(arguments_chunk(self._calls, piece))
        self._given += 1
        self._buffer, self._state = self._buffer[end + len(PARAMETER_END) :], "parameters"
        return True

    def _typed(self, raw: str) -> Any:
        if self._types.get(self._name, {}).get(self._parameter) == "string":
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _closing(self, out: ContentDelta, final: bool) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(END):
            self._buffer, self._state = head[len(END) :], "content"
            return True
        if not final and END.startswith(head):
            return False
        self._buffer, self._state = head, "content"
        return bool(head)


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """For a chat template that ignores `tools`: Qwen3-Coder's instructions, shortened."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + listing + "\n</tools>\n\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
        "</function>\n</tool_call>"
    )


def render_call(name: str, arguments: Any) -> str:
    parameters = "".join(
        f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}\n</parameter>\n"
        for key, value in arguments_object(arguments).items()
    )
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"
