"""What a choice's generated text becomes in the message a client reads.

Every choice runs its text deltas through a ContentProcessor: PlainText (the
text is the content) when nothing parses it; otherwise the reasoning parser
(reasoning.py: `<think>` into `reasoning_content`), a tool-call parser
(tool_parsers/: hermes, llama3_json, or the JSON of a forced call), or the
two chained (tools.py chooses). A processor may hold text back, route it to
`reasoning_content` or turn it into `tool_calls`, and report another finish
reason (e.g. "tool_calls") when the choice ends. Streaming and whole responses get the
same results: a whole message is the merge of the deltas it was built from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ContentDelta:
    content: str = ""
    reasoning_content: str = ""
    # OpenAI tool-call chunks ({"index", "id", "type", "function": {"name",
    # "arguments"}}): chunks with one index are one call, whose arguments
    # may arrive in pieces.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)

    def merge(self, other: ContentDelta) -> None:
        """Append `other` (the next delta) to this accumulated message."""
        self.content += other.content
        self.reasoning_content += other.reasoning_content
        for chunk in other.tool_calls:
            call = next((c for c in self.tool_calls if c.get("index") == chunk.get("index")), None)
            if call is None:
                self.tool_calls.append({**chunk, "function": dict(chunk.get("function", {}))})
                continue
            function = call.setdefault("function", {})
            for key, value in chunk.get("function", {}).items():
                function[key] = function.get(key, "") + value if key == "arguments" else value
            call.update({k: v for k, v in chunk.items() if k not in ("function", "index")})


class ContentProcessor(Protocol):
    def feed(self, text: str) -> ContentDelta:
        """What this new text adds to the message (possibly nothing yet)."""
        ...

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        """What was held back, once the choice ends, and the finish reason to report."""
        ...


class PlainText:
    """The generated text is the message's content."""

    def feed(self, text: str) -> ContentDelta:
        return ContentDelta(content=text)

    def finish(self, finish_reason: str) -> tuple[ContentDelta, str]:
        return ContentDelta(), finish_reason
