"""Where a JSON object or array ends, in text that arrives in pieces.

Tool-call parsers hold a call back until its JSON is complete; this finds
that point without re-parsing the text each time a piece arrives. It only
counts brackets outside strings (escapes included): whether the text is
valid JSON is json.loads' job once the end is found.
"""

from __future__ import annotations


class JsonEndScanner:
    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False

    def feed(self, text: str) -> int | None:
        """Consume `text`; the index just past the end of the object or array
        (which started at the first bracket seen), or None while it is open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]" and self.started:
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class JsonObjectReader:
    """One JSON object or array read across pieces: the text read of it so
    far, and the whole of it once it closes."""

    def __init__(self) -> None:
        self._scanner = JsonEndScanner()
        self.text = ""

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the whole object, the text after it) once it closes; (None, "") while open."""
        end = self._scanner.feed(piece)
        if end is None:
            self.text += piece
            return None, ""
        return self.text + piece[:end], piece[end:]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (to hold back:
    the rest of the tag may come with the next piece)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
