"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.generation import Generation, choice_params, new_id
from aioserve.server.handler_utils import parse_body, run_to_completion, stream_events
from aioserve.server.logprobs import chat_logprobs
from aioserve.server.protocol import ChatCompletionRequest
from aioserve.server.sse import event
from aioserve.tokenizer import ChatTemplateError


async def encode_messages(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    try:
        return await ctx.tokenizer.encode_chat_async(
            [m.template_dict() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
    except ChatTemplateError as exc:
        raise APIError(str(exc), param="messages") from None


async def create_chat_completion(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(body.model)
    if body.tools:
        raise APIError("tool calling is not supported by this server", param="tools")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise APIError("only response_format {'type': 'text'} is supported", param="response_format")
    if body.top_logprobs and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    prompt_ids = await encode_messages(ctx, body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(body.token_limit, logprobs, None)
    generation = Generation(ctx, new_id("chatcmpl"))
    generation.validate(params, prompt_ids)
    for j in range(body.n):
        generation.add(j, 0, prompt_ids, choice_params(params, j))
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            stream_events(generation, _stream(ctx, body, generation, created)), media_type="text/event-stream"
        )
    if not await run_to_completion(request, generation):
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(_response(ctx, body, generation, created))


def _response(ctx: ServingContext, body: ChatCompletionRequest, generation: Generation, created: int) -> dict:
    choices = []
    for choice in generation.choices:
        out = choice.stream
        choices.append(
            {
                "index": choice.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
                if body.logprobs
                else None,
                "finish_reason": out.finish_reason,
            }
        )
    return {
        "id": generation.request_id,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": generation.usage(),
    }


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, generation: Generation, created: int):
    def chunk(choices: list[dict]) -> bytes:
        return event(
            {"id": generation.request_id, "object": "chat.completion.chunk", "created": created,
             "model": ctx.model_name, "choices": choices}
        )

    # The role comes first, in a chunk of its own, as OpenAI sends it.
    yield chunk(
        [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
         for c in generation.choices]
    )
    async for deltas in generation.deltas():
        choices = []
        for choice, delta in deltas:
            logprobs = None
            if body.logprobs and delta.token_ids:
                logprobs = chat_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs)
            if delta.text or logprobs or delta.finish_reason:
                content = {"content": delta.text} if delta.text or logprobs else {}
                choices.append(
                    {"index": choice.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
                )
        if choices:
            yield chunk(choices)
    if body.include_usage:
        yield event(
            {"id": generation.request_id, "object": "chat.completion.chunk", "created": created,
             "model": ctx.model_name, "choices": [], "usage": generation.usage()}
        )
