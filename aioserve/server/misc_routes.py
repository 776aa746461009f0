"""The small endpoints: models, health, tokenize/detokenize, cache flush,
server info."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.chat import encode_messages
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError, from_validation_error
from aioserve.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from aioserve.server.request_body import parse_body
from aioserve.server.responses import (
    DetokenizeResponse,
    FlushCacheResponse,
    ModelCard,
    ModelList,
    ServerInfo,
    TensorParallelInfo,
    TokenizeResponse,
)
from aioserve.server.tools import plan_tools
from aioserve.server.wire import json_response
from aioserve.server.worker_routes import model_path, package_version


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(
        id=ctx.model_name,
        created=ctx.started_at,
        owned_by="aioserve",
        root=str(ctx.args.engine.model),
        max_model_len=ctx.max_model_len,
    )


async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=[_model_card(_ctx(request))]))


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model}; ids may hold slashes ("Qwen/Qwen3-0.6B")."""
    ctx = _ctx(request)
    ctx.check_model(request.path_params["model"])
    return json_response(_model_card(ctx))


async def health(request: Request) -> Response:
    return Response(status_code=200 if _ctx(request).healthy else 503)


async def tokenize(request: Request) -> Response:
    ctx = _ctx(request)
    body = await parse_body(request, TokenizeRequest)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        try:
            chat = ChatCompletionRequest(
                messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt
            )
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        tokens = await encode_messages(ctx, chat, plan_tools(ctx, chat))
    else:
        assert body.prompt is not None
        ctx.check_prompt_chars(len(body.prompt), "prompt")  # bounded as the generation routes are
        tokens = await ctx.tokenizer.encode_async(body.prompt, body.add_special_tokens)
    return json_response(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len))


async def detokenize(request: Request) -> Response:
    ctx = _ctx(request)
    body = await parse_body(request, DetokenizeRequest)
    ctx.check_model(body.model)
    if any(not 0 <= t < ctx.vocab_size for t in body.tokens):
        raise APIError(f"token ids must be in [0, {ctx.vocab_size})", param="tokens")
    return json_response(DetokenizeResponse(prompt=await ctx.tokenizer.decode_async(body.tokens)))


async def flush_cache(request: Request) -> Response:
    if not _ctx(request).scheduler.flush_cache():
        raise APIError("cannot flush the prefix cache while requests are running", status=400)
    return json_response(FlushCacheResponse(flushed=True))


async def server_info(request: Request) -> Response:
    """Configuration, KV pool occupancy and scheduler counters (for ops and
    tests); also GET /get_server_info, SGLang's older name."""
    ctx = _ctx(request)
    info = ctx.scheduler.info(check_integrity=True)
    engine = ctx.args.engine
    return json_response(
        ServerInfo(
            model=ctx.model_name,
            max_model_len=ctx.max_model_len,
            overlap=engine.overlap,
            cache=engine.cache,
            tensor_parallel=TensorParallelInfo(tp_size=engine.tp_size, nnodes=engine.nnodes, ranks=ctx.tp_layout),
            served_model_name=ctx.model_name,
            model_path=model_path(ctx),
            tp_size=engine.tp_size,
            dp_size=1,
            max_running_requests=engine.max_running_requests,
            version=package_version(),
            **vars(info),  # the SchedulerInfo dataclass's fields, flattened
        )
    )
