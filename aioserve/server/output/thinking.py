"""Whether a chat request's output begins with a thought, and its grammar
deferred until the thought ends (aioserve/grammar/after_reasoning.py).

A thought comes first when the server has a reasoning parser, the request
did not turn thinking off (chat_template_kwargs enable_thinking: false, or
the server's default), and the rendered prompt does not already close the
think block (Qwen3's template writes an empty one when thinking is off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aioserve.grammar.after_reasoning import AfterReasoning
from aioserve.server.context import ServingContext
from aioserve.server.output.reasoning import END_THINK

if TYPE_CHECKING:
    from aioserve.server.intake.openai_requests import ChatCompletionRequest

# Enough of the prompt's end to see a closing </think> and the space after it.
TAIL_TOKENS = 8


def chat_template_kwargs(ctx: ServingContext, body: ChatCompletionRequest) -> dict[str, Any]:
    """The request's chat_template_kwargs over the server's defaults (--default-chat-template-kwargs)."""
    return {**(ctx.args.default_chat_template_kwargs or {}), **(body.chat_template_kwargs or {})}


async def thinks_first(ctx: ServingContext, body: ChatCompletionRequest, prompt_ids: list[int]) -> bool:
    if not ctx.args.reasoning_parser:
        return False
    kwargs = chat_template_kwargs(ctx, body)
    if kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False:
        return False
    tail = await ctx.tokenizer.decode_async(prompt_ids[-TAIL_TOKENS:], skip_special_tokens=False)
    return not tail.rstrip().endswith(END_THINK)


async def after_reasoning(ctx: ServingContext, grammar: Any) -> AfterReasoning:
    end_ids = await ctx.tokenizer.run_async(ctx.tokenizer.encode, END_THINK, False)
    return AfterReasoning(grammar, end_ids)
