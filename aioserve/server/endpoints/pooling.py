"""The pooling routes: POST /v1/embeddings (OpenAI's), /v1/rerank and
/rerank (the Jina/Cohere shape vLLM serves), /v1/score and /score (vLLM's).

A server serves one model: a pooling model answers these and refuses the
generating routes; a generating model refuses these, each with the flag that
would change it (ServingContext.check_pools / check_generates)."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aioserve.pooling_config import pair_text
from aioserve.scheduler.pooling import PooledOutput, embedding_vector, relevance
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.pooling_requests import EmbeddingRequest, RerankRequest, ScoreRequest
from aioserve.server.intake.request_body import parse_body
from aioserve.server.output.generation import new_id
from aioserve.server.output.pooled import pool_prompts
from aioserve.server.output.pooling_bodies import (
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    RerankedDocument,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreResponse,
)


async def create_embedding(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, EmbeddingRequest)
    ctx.check_model(body.model)
    pooler = ctx.check_pools("embed", "/v1/embeddings")
    _check_dimensions(ctx, body.dimensions)
    items: list[Any] = [body.input] if isinstance(body.input, str) or isinstance(body.input[0], int) else list(body.input)
    ctx.check_capacity(len(items), request.scope)
    prompts = [await _encode(ctx, item, body.truncate_prompt_tokens, "input") for item in items]
    ctx.admitted(request.scope)
    pooled = await pool_prompts(ctx, prompts, score=False, param="input")
    ctx.metrics.pooled("embeddings", len(prompts), sum(map(len, prompts)))

    def build() -> bytes:  # off the loop: 2048 inputs x 1024 floats is seconds of Python
        data = []
        for i, out in enumerate(pooled):
            vector = embedding_vector(out, pooler.normalize, body.dimensions)
            encoded: list[float] | str = vector if body.encoding_format == "float" else _base64(vector)
            data.append(Embedding(index=i, embedding=encoded))
        tokens = sum(map(len, prompts))
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingList(data=data, model=ctx.model_name, usage=usage).json_bytes()

    return await _json(build)


async def rerank(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, RerankRequest)
    ctx.check_model(body.model)
    ctx.check_pools("classify", "/v1/rerank")
    documents = body.document_texts()
    ctx.check_capacity(len(documents), request.scope)
    prompts = [await _encode_pair(ctx, body.query, d, body.truncate_prompt_tokens, "documents") for d in documents]
    ctx.admitted(request.scope)
    scores = [relevance(out) for out in await pool_prompts(ctx, prompts, score=True, param="documents")]
    ctx.metrics.pooled("rerank", len(prompts), sum(map(len, prompts)))
    order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
    if body.top_n:
        order = order[: body.top_n]
    results = [
        RerankResult(index=i, relevance_score=scores[i],
                     document=RerankedDocument(text=documents[i]) if body.return_documents else None)
        for i in order
    ]
    usage = RerankUsage(total_tokens=sum(map(len, prompts)))
    return await _json(RerankResponse(id=new_id("rerank"), model=ctx.model_name, usage=usage, results=results).json_bytes)


async def score(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, ScoreRequest)
    ctx.check_model(body.model)
    ctx.check_pools("classify", "/v1/score")
    try:
        pairs = body.pairs()
    except ValueError as exc:
        raise APIError(str(exc), param="text_1") from None
    ctx.check_capacity(len(pairs), request.scope)
    prompts = [await _encode_pair(ctx, a, b, body.truncate_prompt_tokens, "text_2") for a, b in pairs]
    ctx.admitted(request.scope)
    pooled: list[PooledOutput] = await pool_prompts(ctx, prompts, score=True, param="text_2")
    ctx.metrics.pooled("score", len(prompts), sum(map(len, prompts)))
    tokens = sum(map(len, prompts))
    data = [ScoreData(index=i, score=relevance(out)) for i, out in enumerate(pooled)]
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return await _json(ScoreResponse(id=new_id("score"), model=ctx.model_name, data=data, usage=usage).json_bytes)


def _check_dimensions(ctx: ServingContext, dimensions: int | None) -> None:
    """`dimensions` only for Matryoshka models (as vLLM), and within the vector."""
    pooler = ctx.pooler
    if dimensions is None or pooler is None:
        return
    if not pooler.matryoshka:
        raise APIError(f"this model does not support Matryoshka embeddings: `dimensions` must be left out "
                       f"(its embeddings have {ctx.hidden_size} dimensions)", param="dimensions")
    if dimensions > ctx.hidden_size:
        raise APIError(f"dimensions {dimensions} is more than the model's {ctx.hidden_size}", param="dimensions")
    listed = pooler.matryoshka_dimensions
    if listed is not None and dimensions not in listed:
        raise APIError(f"dimensions must be one of {list(listed)} for this model", param="dimensions")


async def _encode(ctx: ServingContext, item: str | list[int], keep_last: int | None, param: str) -> list[int]:
    if isinstance(item, str):
        if keep_last is None:
            ctx.check_prompt_chars(len(item), param)
        ids = await ctx.tokenizer.encode_async(item)
    else:
        ids = list(item)
    return _truncated(ctx, ids, keep_last, param)


async def _encode_pair(ctx: ServingContext, first: str, second: str, keep_last: int | None, param: str) -> list[int]:
    if keep_last is None:
        ctx.check_prompt_chars(len(first) + len(second), param)
    assert ctx.pooler is not None
    ids = await ctx.tokenizer.encode_pair_async(first, second, pair_text(ctx.pooler, first, second))
    return _truncated(ctx, ids, keep_last, param)


def _truncated(ctx: ServingContext, ids: list[int], keep_last: int | None, param: str) -> list[int]:
    """vLLM's truncate_prompt_tokens keeps the last N tokens; without it an
    input over the context is a 400 (never silently cut)."""
    if keep_last is not None:
        if keep_last > ctx.max_model_len:
            raise APIError(f"truncate_prompt_tokens {keep_last} is more than the model's context of "
                           f"{ctx.max_model_len} tokens", param="truncate_prompt_tokens")
        return ids[-keep_last:]
    if len(ids) > ctx.max_model_len:
        raise APIError(f"an input has {len(ids)} tokens, more than this model's context of {ctx.max_model_len} "
                       "(truncate_prompt_tokens keeps the last N)", param=param, code="context_length_exceeded")
    return ids


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values' little-endian bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def _json(build: Any) -> Response:
    """A response body made off the event loop (large vectors take a while to write)."""
    payload = await asyncio.get_running_loop().run_in_executor(None, build)
    return Response(payload, media_type="application/json")

