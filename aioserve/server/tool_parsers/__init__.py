"""Tool-call parsers: a model's text -> OpenAI `tool_calls`, one format each,
chosen by --tool-call-parser or detected from the chat template."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aioserve.server.content import ContentProcessor
from aioserve.server.tool_parsers import hermes, llama3_json


@dataclass(frozen=True)
class ToolFormat:
    name: str
    new_parser: Callable[[], ContentProcessor]
    # For chat templates that ignore `tools`: the prompt text that lists them,
    # and how an earlier call of the conversation is written back.
    tools_prompt: Callable[[list[dict[str, Any]]], str]
    render_call: Callable[[str, Any], str]


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", hermes.HermesToolParser, hermes.tools_prompt, hermes.render_call),
    "llama3_json": ToolFormat(
        "llama3_json", llama3_json.Llama3JsonToolParser, llama3_json.tools_prompt, llama3_json.render_call
    ),
}
ALIASES = {"qwen": "hermes", "qwen3": "hermes", "qwen25": "hermes", "llama3": "llama3_json", "llama": "llama3_json"}
CHOICES = ("auto", "none", *FORMATS, *ALIASES)


def detect(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, if we know it."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "tools" in template):
        return "llama3_json"
    return None


def resolve(option: str | None, chat_template: str | None) -> ToolFormat | None:
    """The format for --tool-call-parser `option` (auto: from the template)."""
    if option in (None, "auto"):
        name = detect(chat_template)
    elif option == "none":
        name = None
    else:
        name = ALIASES.get(option, option)
    return FORMATS[name] if name else None
