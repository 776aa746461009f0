"""The small endpoints: models, health, tokenize/detokenize, cache flush,
server info."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aioserve.server.chat import encode_messages
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.handler_utils import parse_body
from aioserve.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


async def list_models(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.started_at,
        "owned_by": "aioserve",
        "root": str(ctx.args.engine.model),
        "max_model_len": ctx.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    return Response(status_code=200 if _ctx(request).healthy else 503)


async def tokenize(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    body = await parse_body(request, TokenizeRequest)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
        tokens = await encode_messages(ctx, chat)
    else:
        tokens = await ctx.tokenizer.encode_async(body.prompt, body.add_special_tokens)  # type: ignore[arg-type]
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len})


async def detokenize(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    body = await parse_body(request, DetokenizeRequest)
    ctx.check_model(body.model)
    if any(not 0 <= t < ctx.vocab_size for t in body.tokens):
        raise APIError(f"token ids must be in [0, {ctx.vocab_size})", param="tokens")
    return JSONResponse({"prompt": await ctx.tokenizer.decode_async(body.tokens)})


async def flush_cache(request: Request) -> JSONResponse:
    if not _ctx(request).scheduler.flush_cache():
        raise APIError("cannot flush the prefix cache while requests are running", status=400)
    return JSONResponse({"flushed": True})


async def server_info(request: Request) -> JSONResponse:
    """Configuration, KV pool occupancy and scheduler counters (for ops and tests)."""
    ctx = _ctx(request)
    scheduler = ctx.scheduler
    kv = scheduler.kv
    try:
        scheduler.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = str(exc)
    return JSONResponse(
        {
            "model": ctx.model_name,
            "max_model_len": ctx.max_model_len,
            "page_size": kv.page_size,
            "kv_pages_total": kv.num_usable_pages,
            "kv_pages_free": kv.allocator.num_free,
            "kv_pages_cached": kv.cache.num_pages,
            "kv_pages_evictable": kv.cache.num_evictable_pages,
            "kv_integrity": integrity,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "overlap": ctx.args.engine.overlap,
            "cache": ctx.args.engine.cache,
            "max_prefill_tokens": ctx.args.engine.max_prefill_tokens,
            "stats": vars(scheduler.stats),
        }
    )
