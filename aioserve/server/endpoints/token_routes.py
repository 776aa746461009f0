"""POST /tokenize and /detokenize: the served tokenizer (and chat template) as a service."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.context import ServingContext
from aioserve.server.endpoints.chat import encode_messages
from aioserve.server.errors import APIError, from_validation_error
from aioserve.server.intake.openai_requests import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from aioserve.server.intake.request_body import parse_body
from aioserve.server.output.service_bodies import DetokenizeResponse, TokenizeResponse
from aioserve.server.output.tools import plan_tools
from aioserve.server.wire import json_response


async def tokenize(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, TokenizeRequest)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        try:
            chat = ChatCompletionRequest(
                messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs,
            )
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        # A vision-language model's images are read and processed as the chat
        # request's would be: the count holds each image's tokens.
        tokens, _ = await encode_messages(ctx, chat, plan_tools(ctx, chat))
    else:
        assert body.prompt is not None
        ctx.check_prompt_chars(len(body.prompt), "prompt")  # bounded as the generation routes are
        tokens = await ctx.tokenizer.encode_async(body.prompt, body.add_special_tokens)
    return json_response(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len))


async def detokenize(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, DetokenizeRequest)
    ctx.check_model(body.model)
    if any(not 0 <= t < ctx.vocab_size for t in body.tokens):
        raise APIError(f"token ids must be in [0, {ctx.vocab_size})", param="tokens")
    return json_response(DetokenizeResponse(prompt=await ctx.tokenizer.decode_async(body.tokens)))
