"""Tool calling for a chat request: what the template gets, what constrains
the output, and which content processor reads the calls back.

* `tool_choice` "none": tools are still shown to the template (earlier turns
  may refer to them) but nothing is parsed.
* "auto" (the default with tools): the model's own call format is parsed
  (--tool-call-parser, or the format the chat template teaches).
* "required" or a named function: a JSON-schema grammar forces the calls, so
  they are always valid; they are read from that JSON directly.

Chat templates that ignore `tools` (Llama 3.0's) get them in a system
message and earlier calls written in the parser's format, so a conversation
with tool results still round-trips.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aioserve.sampling_params import StructuredOutputParams
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.openai_requests import ChatCompletionRequest
from aioserve.server.intake.structured import StructuredRequest
from aioserve.server.output import tool_parsers
from aioserve.server.output.content import ContentProcessor, PlainText
from aioserve.server.output.reasoning import Chained, new_reasoning_parser
from aioserve.server.output.tool_parsers.forced import NamedCall, RequiredCalls, named_schema, required_schema


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]]  # as the template takes them (OpenAI's shape)
    named: str | None = None
    format: tool_parsers.ToolFormat | None = None
    grammar: StructuredRequest | None = None
    stream: bool = False  # a stream's calls go out with their arguments in pieces

    @property
    def keeps_special_tokens(self) -> bool:
        return self.mode == "auto" and self.format is not None and self.format.keeps_special_tokens

    def template_kwargs(self) -> dict[str, Any]:
        return {"tools": self.tools} if self.tools else {}

    def new_parser(self) -> ContentProcessor | None:
        if self.mode == "named":
            assert self.named is not None
            return NamedCall(self.named)
        if self.mode == "required":
            return RequiredCalls()
        if self.mode == "auto" and self.format is not None:
            return self.format.new_parser(self.tools, self.stream)
        return None


def plan_tools(ctx: ServingContext, body: ChatCompletionRequest) -> ToolPlan:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice not in ("none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none", [])
    functions = {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', param="tool_choice")
        if name not in functions:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        spec = StructuredOutputParams(json=named_schema(functions[name]))
        return ToolPlan("named", tools, named=name, grammar=StructuredRequest(spec, "tools"))
    if choice == "required":
        spec = StructuredOutputParams(json=required_schema(list(functions.items()), body.parallel_tool_calls))
        return ToolPlan("required", tools, grammar=StructuredRequest(spec, "tools"))
    if choice == "auto" and not ctx.args.auto_tool_choice:
        raise APIError(
            'tool_choice "auto" is off on this server (started with --disable-auto-tool-choice); '
            'use "required", a named function or "none"',
            param="tool_choice",
        )
    fmt = tool_parsers.resolve(ctx.args.tool_call_parser, ctx.tokenizer.hf.chat_template)
    if choice == "auto" and fmt is None:
        raise APIError(
            'tool_choice "auto" needs a tool-call format: start the server with --tool-call-parser '
            f"({', '.join(tool_parsers.FORMATS)}); this chat template's could not be detected",
            param="tool_choice",
        )
    return ToolPlan(choice, tools, format=fmt, stream=body.stream)


def template_messages(plan: ToolPlan, messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """Messages as the chat template should see them: unchanged when it
    renders tools itself; otherwise tools listed in the system message and
    earlier calls written out in the parser's format."""
    fmt = plan.format or tool_parsers.resolve(None, template) or tool_parsers.FORMATS["hermes"]
    if "tools" in (template or "") or not (plan.tools or any(m.get("tool_calls") for m in messages)):
        return messages
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [fmt.render_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message.get("content") else []) + calls)
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
        out.append(message)
    if plan.tools:
        prompt = fmt.tools_prompt(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def content_processors(ctx: ServingContext, plan: ToolPlan, thinking: bool = False) -> Callable[[object], ContentProcessor]:
    """A new processor per choice: reasoning (--reasoning-parser), then tool calls.
    A forced call (required / named) is JSON from the first token, unless the
    model thinks first (its grammar then starts after the thought)."""
    forced = plan.mode in ("required", "named")
    reasoning = ctx.args.reasoning_parser if thinking or not forced else None

    def new_processor(choice: object) -> ContentProcessor:
        tools = plan.new_parser()
        if reasoning:
            return Chained(new_reasoning_parser(reasoning), tools or PlainText())
        return tools or PlainText()

    return new_processor
