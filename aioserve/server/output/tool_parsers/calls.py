"""Tool calls as OpenAI's chat API carries them, and the JSON a model writes
for one call: {"name": ..., "arguments" | "parameters": {...}}."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(text: str) -> ParsedCall | None:
    """One call from its JSON text; None when it is not one (malformed JSON,
    no name): the parser then shows the text as content."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call_from_object(value)


def call_from_object(value: Any) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)  # some models write the arguments as a JSON string
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def call_chunk(index: int, call: ParsedCall) -> dict[str, Any]:
    """A whole call as one stream chunk (and, merged, as the message's call)."""
    return {
        "index": index, "id": new_call_id(), "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def arguments_object(arguments: Any) -> dict[str, Any]:
    """An earlier call's arguments as a mapping (clients send them as JSON
    text or as an object), for formats that write each argument out."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}
