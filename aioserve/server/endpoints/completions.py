"""POST /v1/completions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.body.checks import prompt_count
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.openai_requests import CompletionRequest
from aioserve.server.intake.request_body import parse_body
from aioserve.server.intake.structured import compile_grammar, structured_request
from aioserve.server.output.assembly import ChoiceUpdate, respond
from aioserve.server.output.completion_bodies import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
    openai_finish_reason,
)
from aioserve.server.output.generation import Choice, Generation, new_id
from aioserve.server.output.logprobs import completion_logprobs, prompt_text_offsets
from aioserve.server.output.prompt_logprobs import vllm_prompt_logprobs
from aioserve.server.request_metrics import arrival_time
from aioserve.server.wire import WireModel


@dataclass
class Prompt:
    text: str | None  # None for token ids: decoded only if echoed
    ids: list[int]
    text_offsets: list[int] | None = None  # where each token's text starts: only if echoed with logprobs


async def prompt_list(ctx: ServingContext, prompt: Any) -> list[Prompt]:
    """A string, strings, token ids, or lists of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    encoded = iter(await ctx.encode_prompts([item for item in prompt if isinstance(item, str)], "prompt"))
    return [Prompt(item, next(encoded)) if isinstance(item, str) else Prompt(None, list(item)) for item in prompt]


async def create_completion(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, CompletionRequest)
    adapter = ctx.check_model(body.model)
    ctx.check_generates()
    ctx.check_capacity(prompt_count(body.prompt) * body.n, request.scope)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError("best_of is not supported (only best_of == n)", param="best_of")
    if body.suffix:
        raise APIError("suffix is not supported", param="suffix")
    constraint = structured_request(body)
    prompts = await prompt_list(ctx, body.prompt)
    grammar = await compile_grammar(ctx, constraint, request.scope)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    # The prompt is scored once, for the echo's logprobs and for vLLM's prompt_logprobs alike.
    wanted = [n for n in (echo_logprobs, body.prompt_logprobs) if n is not None]
    params = body.sampling_params(body.max_tokens, body.logprobs, max(wanted, default=None), ctx.generation_defaults)
    params.structured_outputs = constraint.spec if constraint else None
    if body.echo:  # token-id prompts are decoded only to be echoed; both off the loop
        for p in prompts:
            if p.text is None:
                p.text = await ctx.tokenizer.decode_async(p.ids)
            if body.logprobs is not None:
                p.text_offsets = await ctx.tokenizer.run_async(prompt_text_offsets, ctx.tokenizer, p.ids)
    generation = Generation(ctx, new_id("cmpl"), arrival_time(request), incremental=body.stream)
    generation.start([p.ids for p in prompts], params, body.n, grammar, adapter)
    ctx.admitted(request.scope)
    builder = CompletionBuilder(ctx, body, generation.request_id, prompts)
    return await respond(request, generation, builder, stream=body.stream, include_usage=body.include_usage)


class CompletionBuilder:
    """Chunks and whole responses share one shape. With echo, the prompt's
    text and logprobs come first (in a stream: in the choice's first chunk),
    and text offsets count from the start of the prompt's text."""

    def __init__(self, ctx: ServingContext, body: CompletionRequest, request_id: str, prompts: list[Prompt]) -> None:
        self.ctx = ctx
        self.body = body
        self.request_id = request_id
        self.created = int(time.time())
        self._prompts = prompts
        self._echo_texts = [self._echo_text(p) for p in prompts] if body.echo else []
        self._echoed: set[int] = set()

    def opening(self, choices: list[Choice]) -> list[WireModel]:
        return []

    def chunk(self, updates: list[ChoiceUpdate]) -> list[WireModel]:
        choices = []
        for update in updates:
            echo = self.body.echo and update.choice.index not in self._echoed
            self._echoed.add(update.choice.index)
            choice = self._choice(update, echo)
            # A token that only begins a character sends nothing, unless its logprob is wanted.
            if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                choices.append(choice)
        return [self._completion(choices)] if choices else []

    def usage_chunk(self, usage: Usage) -> list[WireModel]:
        return [self._completion([], usage)]

    def whole(self, results: list[ChoiceUpdate], usage: Usage) -> BaseModel:
        return self._completion([self._choice(update, self.body.echo) for update in results], usage)

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(
            id=self.request_id, created=self.created, model=self.ctx.model_name, choices=choices, usage=usage
        )

    def _echo_text(self, prompt: Prompt) -> str:
        assert prompt.text is not None, "create_completion decodes the prompts it echoes"
        return prompt.text

    def _choice(self, update: ChoiceUpdate, echo: bool) -> CompletionChoice:
        prompt_text = self._echo_texts[update.choice.prompt_index] if echo else ""
        prompt_logprobs = None
        if self.body.prompt_logprobs is not None:
            choice = update.choice
            prompt_logprobs = vllm_prompt_logprobs(
                self.ctx.tokenizer, choice.prompt_ids, choice.stream, self.body.prompt_logprobs
            )
        return CompletionChoice(
            index=update.choice.index,
            text=prompt_text + update.content.content,
            logprobs=self._logprobs(update, echo),
            finish_reason=openai_finish_reason(update.finish_reason),
            stop_reason=update.choice.stream.stop_reason if update.finish_reason else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _logprobs(self, update: ChoiceUpdate, echo: bool) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        out = update.output
        base = len(self._echo_texts[update.choice.prompt_index]) if self.body.echo else 0
        ids, tops = list(out.token_ids), list(out.top_logprobs)
        logprobs: list[float | None] = list(out.logprobs)
        offsets = [base + offset for offset in out.text_offsets]
        if echo:
            prompt_ids = update.choice.prompt_ids
            prompt_lps, prompt_tops = _prompt_logprobs(update.choice, self.body.logprobs)
            ids, logprobs, tops = prompt_ids + ids, prompt_lps + logprobs, prompt_tops + tops
            prompt_offsets = self._prompts[update.choice.prompt_index].text_offsets
            assert prompt_offsets is not None, "create_completion finds them for an echo with logprobs"
            offsets = prompt_offsets + offsets
        return completion_logprobs(self.ctx.tokenizer, ids, logprobs, tops, offsets)


def _prompt_logprobs(choice: Choice, num_top: int) -> tuple[list[float | None], list]:
    """The prompt's logprobs and `num_top` top logprobs: none for the first
    token (nor for any the scheduler did not report)."""
    entries = list(choice.stream.prompt_logprobs or [])
    entries += [None] * (len(choice.prompt_ids) - len(entries))
    return [e[0] if e else None for e in entries], [e[1][:num_top] if e else None for e in entries]
