"""One JSON tool call, {"name": ..., "arguments" | "parameters": {...}},
turned into OpenAI's stream form as its text arrives: a first chunk with the
call's id, type and name once the name is read and the arguments object has
begun, then the arguments' text in pieces as the model writes them.

A call written another way (the arguments before the name, the arguments as
a JSON string) is read whole and goes out as one chunk when its object
closes; an object that is no call at all is reported as such, for the
parser to show as the text it was.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aioserve.server.output.tool_parsers.calls import call_chunk, new_call_id, parse_call
from aioserve.server.output.tool_parsers.json_scan import JsonEndScanner

# The head of a call written name first: the arguments object begins after it.
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def header_chunk(index: int, name: str) -> dict[str, Any]:
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}


def arguments_chunk(index: int, text: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": text}}


@dataclass
class CallStep:
    chunks: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False  # the call's object has ended
    rest: str = ""  # text after it
    not_a_call: bool = False  # closed, and it was no call: show `text` as written


class StreamedJsonCall:
    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""  # everything read of the object
        self.committed = False  # the header went out: the call is streamed
        self._outer = JsonEndScanner()
        self._arguments: JsonEndScanner | None = None
        self._arguments_done = False

    def feed(self, piece: str) -> CallStep:
        step = CallStep()
        end = self._outer.feed(piece)
        taken = piece if end is None else piece[:end]
        before = len(self.text)
        self.text += taken
        if not self.committed:
            self._try_commit(step)
        elif not self._arguments_done:
            self._stream_arguments(step, self.text[before:])
        if end is not None:
            step.closed, step.rest = True, piece[end:]
            if not self.committed:
                call = parse_call(self.text)
                if call is None:
                    step.not_a_call = True
                else:
                    step.chunks.append(call_chunk(self.index, call))
        return step

    def _try_commit(self, step: CallStep) -> None:
        head = HEAD.match(self.text)
        if head is None:
            return
        after = self.text[head.end():]
        if not after:
            return  # the value's first character decides
        if not after.startswith("{"):
            return  # arguments as a string (or anything else): read whole
        try:
            name = _unescape(head.group(1))
        except ValueError:
            return
        self.committed = True
        step.chunks.append(header_chunk(self.index, name))
        self._arguments = JsonEndScanner()
        self._stream_arguments(step, after)

    def _stream_arguments(self, step: CallStep, text: str) -> None:
        assert self._arguments is not None
        end = self._arguments.feed(text)
        if end is not None:
            text, self._arguments_done = text[:end], True
        if text:
            step.chunks.append(arguments_chunk(self.index, text))


def _unescape(name: str) -> str:
    value = json.loads(f'"{name}"')
    if not value:
        raise ValueError("empty name")
    return value
