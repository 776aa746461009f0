"""Tool-call parsers: a model's text -> OpenAI `tool_calls`, one format each,
chosen by --tool-call-parser or detected from the chat template."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aioserve.server.output.content import ContentProcessor
from aioserve.server.output.tool_parsers import hermes, llama3_json, mistral, pythonic, qwen3_coder

# (the request's tools, whether the arguments stream in pieces) -> a parser.
NewParser = Callable[[list[dict[str, Any]], bool], ContentProcessor]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    new_parser: NewParser
    # For chat templates that ignore `tools`: the prompt text that lists them,
    # and how an earlier call of the conversation is written back.
    tools_prompt: Callable[[list[dict[str, Any]]], str]
    render_call: Callable[[str, Any], str]
    # Its markers are special tokens, which the output text must keep.
    keeps_special_tokens: bool = False


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(
        "hermes", lambda tools, stream: hermes.HermesToolParser(stream), hermes.tools_prompt, hermes.render_call
    ),
    "llama3_json": ToolFormat(
        "llama3_json", lambda tools, stream: llama3_json.Llama3JsonToolParser(stream),
        llama3_json.tools_prompt, llama3_json.render_call,
    ),
    "mistral": ToolFormat(
        "mistral", lambda tools, stream: mistral.MistralToolParser(), mistral.tools_prompt, mistral.render_call,
        keeps_special_tokens=True,
    ),
    "pythonic": ToolFormat(
        "pythonic", lambda tools, stream: pythonic.PythonicToolParser(), pythonic.tools_prompt, pythonic.render_call
    ),
    "qwen3_coder": ToolFormat(
        "qwen3_coder", lambda tools, stream: qwen3_coder.Qwen3CoderToolParser(tools),
        qwen3_coder.tools_prompt, qwen3_coder.render_call,
    ),
}
ALIASES = {
    "qwen": "hermes", "qwen3": "hermes", "qwen25": "hermes", "llama3": "llama3_json", "llama": "llama3_json",
    "llama4_pythonic": "pythonic", "qwen3_xml": "qwen3_coder",
}
CHOICES = ("auto", "none", *FORMATS, *ALIASES)


def detect(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, if we know it."""
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_start|>" in template or "[func_name1(" in template:
        return "pythonic"
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
