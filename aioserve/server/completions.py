"""POST /v1/completions."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.generation import Choice, Generation, choice_params, new_id
from aioserve.server.handler_utils import parse_body, run_to_completion, stream_events
from aioserve.server.logprobs import completion_logprobs
from aioserve.server.protocol import CompletionRequest
from aioserve.server.sse import event


async def prompt_token_lists(ctx: ServingContext, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """(text, ids) for each prompt: a string, strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    result = []
    for item in prompt:
        if isinstance(item, str):
            result.append((item, await ctx.tokenizer.encode_async(item)))
        else:
            result.append((None, list(item)))
    return result


def _echo_logprobs(choice: Choice) -> tuple[list[int], list[float | None], list]:
    """The prompt part of echoed logprobs: the first token has none."""
    entries = choice.stream.prompt_logprobs or [None]
    logprobs = [None] + [lp for lp, _ in entries[1:]]  # type: ignore[misc]
    tops = [None] + [top for _, top in entries[1:]]  # type: ignore[misc]
    return choice.prompt_ids, logprobs, tops


async def create_completion(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, CompletionRequest)
    ctx.check_model(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError("best_of is not supported (only best_of == n)", param="best_of")
    if body.suffix:
        raise APIError("suffix is not supported", param="suffix")
    prompts = await prompt_token_lists(ctx, body.prompt)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = body.sampling_params(body.max_tokens, body.logprobs, echo_logprobs)
    generation = Generation(ctx, new_id("cmpl"))
    for _, ids in prompts:
        generation.validate(params, ids)
    for p, (_, ids) in enumerate(prompts):
        for j in range(body.n):
            generation.add(p * body.n + j, p, ids, choice_params(params, j))
    texts = [text if text is not None else ctx.tokenizer.decode(ids) for text, ids in prompts]
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            stream_events(generation, _stream(ctx, body, generation, texts, created)),
            media_type="text/event-stream",
        )
    if not await run_to_completion(request, generation):
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(_response(ctx, body, generation, texts, created))


def _choice_logprobs(ctx: ServingContext, body: CompletionRequest, choice: Choice, ids, logprobs, tops, echo: bool):
    if body.logprobs is None:
        return None
    if echo:
        p_ids, p_lps, p_tops = _echo_logprobs(choice)
        ids, logprobs, tops = p_ids + ids, p_lps + logprobs, p_tops + tops
    return completion_logprobs(ctx.tokenizer, ids, logprobs, tops)


def _response(ctx: ServingContext, body: CompletionRequest, generation: Generation, texts: list[str], created: int) -> dict:
    choices = []
    for choice in generation.choices:
        out = choice.stream
        text = (texts[choice.prompt_index] if body.echo else "") + out.text
        choices.append(
            {
                "index": choice.index,
                "text": text,
                "logprobs": _choice_logprobs(ctx, body, choice, out.token_ids, out.logprobs, out.top_logprobs, body.echo),
                "finish_reason": out.finish_reason,
            }
        )
    return {
        "id": generation.request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": generation.usage(),
    }


async def _stream(ctx: ServingContext, body: CompletionRequest, generation: Generation, texts: list[str], created: int):
    def chunk(choices: list[dict]) -> bytes:
        return event(
            {"id": generation.request_id, "object": "text_completion", "created": created, "model": ctx.model_name, "choices": choices}
        )

    echoed: set[int] = set()
    async for deltas in generation.deltas():
        choices = []
        for choice, delta in deltas:
            echo = body.echo and choice.index not in echoed
            echoed.add(choice.index)
            text = (texts[choice.prompt_index] if echo else "") + delta.text
            logprobs = _choice_logprobs(ctx, body, choice, delta.token_ids, delta.logprobs, delta.top_logprobs, echo)
            if text or logprobs or delta.finish_reason:  # a held-back partial character sends nothing
                choices.append({"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason})
        if choices:
            yield chunk(choices)
    if body.include_usage:
        yield event(
            {"id": generation.request_id, "object": "text_completion", "created": created, "model": ctx.model_name,
             "choices": [], "usage": generation.usage()}
        )
