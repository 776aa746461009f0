"""Reasoning parsers: a thinking model's `<think>...</think>` goes to
`reasoning_content`, the rest to `content` (and on to the tool-call parser).

* qwen3: reasoning only when the output opens with `<think>`; an output that
  does not (enable_thinking: false puts an empty think block in the prompt)
  is all content.
* deepseek_r1: the template opens the think block in the prompt, so the
  output is reasoning from its start (a leading `<think>` is dropped) until
  `</think>`; without one, all of it is reasoning.

Streaming holds back only what may be the start of a tag, and the
whitespace at the end of the reasoning (emitted once more reasoning follows).
"""

from __future__ import annotations

from aioserve.server.output.content import ContentDelta, ContentProcessor
from aioserve.server.output.tool_parsers.json_scan import partial_suffix

THINK, END_THINK = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ThinkParser:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self._mode = "undecided"  # undecided | reasoning | content
        self._starts_in_reasoning = starts_in_reasoning
        self._buffer = ""
        self._reasoning_started = False  # its leading newlines are dropped
        self._content_started = False  # likewise, after </think>

    def feed(self, text: str) -> ContentDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        return self._drain(final=True), finish_reason

    def _drain(self, final: bool) -> ContentDelta:
        out = ContentDelta()
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if not final and THINK.startswith(head):
                return out  # too early to tell (empty, or a partial <think>)
            if head.startswith(THINK):
                self._buffer, self._mode = head[len(THINK) :], "reasoning"
            else:
                self._mode = "reasoning" if self._starts_in_reasoning else "content"
        if self._mode == "reasoning":
            end = self._buffer.find(END_THINK)
            if end < 0:
                keep = 0 if final else _held_back(self._buffer)
                self._reasoning(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            self._reasoning(out, self._buffer[:end].rstrip())
            self._buffer, self._mode = self._buffer[end + len(END_THINK) :], "content"
        if self._mode == "content":
            if not self._content_started:
                self._buffer = self._buffer.lstrip()
                self._content_started = bool(self._buffer)
            out.content, self._buffer = self._buffer, ""
        return out

    def _reasoning(self, out: ContentDelta, text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        out.reasoning_content += text


def _held_back(text: str) -> int:
    """What may begin </think>, and the whitespace before it (which is dropped
    if the tag follows)."""
    tag = partial_suffix(text, END_THINK)
    before = text[: len(text) - tag]
    return tag + len(before) - len(before.rstrip())


def new_reasoning_parser(name: str) -> ThinkParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (choose from {', '.join(PARSERS)})")
    return ThinkParser(starts_in_reasoning=name == "deepseek_r1")


class Chained:
    """Reasoning first; what it leaves as content goes through `then` (tool calls)."""

    def __init__(self, first: ContentProcessor, then: ContentProcessor) -> None:
        self.first = first
        self.then = then

    def feed(self, text: str) -> ContentDelta:
        head = self.first.feed(text)
        tail = self.then.feed(head.content) if head.content else ContentDelta()
        tail.reasoning_content = head.reasoning_content + tail.reasoning_content
        return tail

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        head, reason = self.first.finish(finish_reason)
        tail = self.then.feed(head.content) if head.content else ContentDelta()
        rest, reason = self.then.finish(reason)
        tail.merge(rest)
        tail.reasoning_content = head.reasoning_content + tail.reasoning_content
        return tail, reason
