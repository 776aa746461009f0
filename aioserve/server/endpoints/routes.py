"""The route table: every API endpoint once, read by the app (app.py) and
by the OpenAPI document (openapi/document.py). The chat page (page.py) is
not API and stays out of the document."""

from __future__ import annotations

import os
from functools import cache

from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.endpoints import lora_routes, model_routes, ops_routes, pooling, token_routes, worker_routes
from aioserve.server.endpoints.chat import create_chat_completion
from aioserve.server.endpoints.completions import create_completion
from aioserve.server.endpoints.generate import generate
from aioserve.server.endpoints.metrics import metrics
from aioserve.server.endpoints.responses_api import create_response
from aioserve.server.openapi import operations as op
from aioserve.server.openapi.docs_routes import DOCS_INIT, docs_init, docs_page
from aioserve.server.openapi.document import document_bytes
from aioserve.server.openapi.endpoint import Endpoint
from aioserve.server.openapi.operations import ref


@cache
def _document_bytes(secured: bool) -> bytes:
    return document_bytes(ENDPOINTS, secured)


async def openapi_json(request: Request) -> Response:
    ctx = getattr(request.app.state, "ctx", None)
    secured = bool((ctx is not None and ctx.args.api_key) or os.environ.get("AIOSERVE_API_KEY"))
    return Response(_document_bytes(secured), media_type="application/json")


_HTML = {"200": {"description": "HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}}
_SCRIPT = {"200": {"description": "JavaScript", "content": {"text/javascript": {"schema": {"type": "string"}}}}}
_HEALTH = {"200": {"description": "Healthy (empty body)"}, "503": {"description": "Unhealthy"}}
_METRICS = {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/v1/completions", "POST", create_completion, op.generating(
        "OpenAI completions", "createCompletion", "CompletionRequest", ref("Completion"), ref("Completion"))),
    Endpoint("/v1/chat/completions", "POST", create_chat_completion, op.generating(
        "OpenAI chat completions", "createChatCompletion", "ChatCompletionRequest",
        ref("ChatCompletion"), ref("ChatCompletionChunk"))),
    Endpoint("/v1/models", "GET", model_routes.list_models, op.get(
        "The served model, as a list", "listModels", ref("ModelList"))),
    Endpoint("/v1/models/{model:path}", "GET", model_routes.retrieve_model, op.with_path_parameter(
        op.get("The served model", "retrieveModel", ref("ModelCard"), (401, 404, 500, 503)),
        "model", "The served model's name; it may hold slashes (Qwen/Qwen3-0.6B).")),
    Endpoint("/generate", "POST", generate, op.generating(
        "SGLang's native generate (one output, or a list for a batch or n > 1)", "generate",
        "GenerateRequest", {"anyOf": [ref("GenerateOutput"), ref("GenerateBatch")]}, ref("GenerateOutput"))),
    Endpoint("/health", "GET", ops_routes.health, op.probe(
        "200 while the server can serve; 503 while it shuts down or once its scheduler has stopped",
        "health", _HEALTH), open=True),
    Endpoint("/tokenize", "POST", token_routes.tokenize, op.post(
        "Tokenize a prompt or chat messages", "tokenize", "TokenizeRequest", ref("TokenizeResponse"),
        op.POST_ERRORS)),
    Endpoint("/detokenize", "POST", token_routes.detokenize, op.post(
        "Decode token ids", "detokenize", "DetokenizeRequest", ref("DetokenizeResponse"), op.POST_ERRORS)),
    Endpoint("/flush_cache", "POST", ops_routes.flush_cache, op.post(
        "Empty the prefix cache (400 while requests run)", "flushCache", None, ref("FlushCacheResponse"),
        (400, 401, 500, 503))),
    Endpoint("/server_info", "GET", ops_routes.server_info, op.get(
        "Configuration, KV pool occupancy, scheduler counters", "serverInfo", ref("ServerInfo"))),
    # SGLang's worker endpoints, for a router in front of replicas (worker_routes.py).
    Endpoint("/get_server_info", "GET", ops_routes.server_info, op.get(
        "/server_info under SGLang's older name", "getServerInfo", ref("ServerInfo"))),
    Endpoint("/model_info", "GET", worker_routes.model_info, op.get(
        "The model, in SGLang's fields", "modelInfo", ref("ModelInfo"))),
    Endpoint("/get_model_info", "GET", worker_routes.model_info, op.get(
        "/model_info under SGLang's older name", "getModelInfo", ref("ModelInfo"))),
    Endpoint("/get_load", "GET", worker_routes.get_load, op.get(
        "Requests and KV tokens held, as SGLang's list (one entry)", "getLoad",
        {"type": "array", "items": ref("WorkerLoad")})),
    Endpoint("/health_generate", "GET", worker_routes.health_generate, op.status_only(
        "200 once a one-token generation came back; 503 if it failed or the server is unhealthy",
        "healthGenerate", _HEALTH, (401,))),
    Endpoint("/version", "GET", worker_routes.version_info, op.get(
        "The aioserve version", "version", ref("VersionInfo"))),
    Endpoint("/metrics", "GET", metrics, op.probe("Prometheus metrics", "metrics", _METRICS), open=True),
    # Open like /docs, whose page reads it (as vLLM keeps both): the document
    # holds no data, and a 401 here left Swagger UI blank under --api-key.
    Endpoint("/openapi.json", "GET", openapi_json, {**op.get("This document", "openapi", {"type": "object"}, ()), "security": []},
             open=True),
    # For users of vLLM and SGLang (docs/compatibility.md).
    Endpoint("/v1/tokenize", "POST", token_routes.tokenize, op.post(
        "Tokenize a prompt or chat messages (as /tokenize)", "tokenizeV1", "TokenizeRequest",
        ref("TokenizeResponse"), op.POST_ERRORS)),
    Endpoint("/v1/detokenize", "POST", token_routes.detokenize, op.post(
        "Decode token ids (as /detokenize)", "detokenizeV1", "DetokenizeRequest", ref("DetokenizeResponse"),
        op.POST_ERRORS)),
    Endpoint("/v1/responses", "POST", create_response, op.generating(
        "OpenAI Responses API (stateless: previous_response_id is refused)", "createResponse", "ResponsesRequest",
        ref("Response"),
        {"type": "object", "description": "A typed stream event (response.created ... response.completed), "
         "whose `response`, `item` and `part` fields hold the Response, its output items and OutputTextContent"})),
    # Pooling models (docs/guide/retrieval.md): a generating model answers these with a 400.
    Endpoint("/v1/embeddings", "POST", pooling.create_embedding, op.post(
        "OpenAI embeddings (a pooling model: --runner pooling)", "createEmbedding", "EmbeddingRequest",
        ref("CreateEmbeddingResponse"), op.POST_ERRORS)),
    Endpoint("/v1/rerank", "POST", pooling.rerank, op.post(
        "Rerank documents against a query, in the Jina/Cohere shape vLLM serves (a cross-encoder)", "rerank",
        "RerankRequest", ref("RerankResponse"), op.POST_ERRORS)),
    Endpoint("/rerank", "POST", pooling.rerank, op.post(
        "/v1/rerank without the version prefix", "rerankUnversioned", "RerankRequest", ref("RerankResponse"),
        op.POST_ERRORS)),
    Endpoint("/v1/score", "POST", pooling.score, op.post(
        "vLLM's score: text_1 against each text_2 (a cross-encoder)", "score", "ScoreRequest",
        ref("ScoreResponse"), op.POST_ERRORS)),
    Endpoint("/score", "POST", pooling.score, op.post(
        "/v1/score without the version prefix", "scoreUnversioned", "ScoreRequest", ref("ScoreResponse"),
        op.POST_ERRORS)),
    # LoRA adapters at run time (--enable-lora; docs/guide/lora.md): vLLM's pair, then SGLang's.
    Endpoint("/v1/load_lora_adapter", "POST", lora_routes.load_lora_adapter, op.post_text(
        "Load a PEFT LoRA adapter under a name (vLLM's route; a plain-text answer)", "loadLoraAdapter",
        "LoadLoraAdapterRequest", op.POST_ERRORS)),
    Endpoint("/v1/unload_lora_adapter", "POST", lora_routes.unload_lora_adapter, op.post_text(
        "Unload a LoRA adapter; its running requests finish on it (vLLM's route)", "unloadLoraAdapter",
        "UnloadLoraAdapterRequest", (400, 401, 404, 500, 503))),
    Endpoint("/load_lora_adapter", "POST", lora_routes.load_lora_adapter_sglang, op.post(
        "Load a PEFT LoRA adapter (SGLang's route)", "loadLoraAdapterSglang", "LoadLoraAdapterRequest",
        ref("LoraAdapterUpdate"), op.POST_ERRORS)),
    Endpoint("/unload_lora_adapter", "POST", lora_routes.unload_lora_adapter_sglang, op.post(
        "Unload a LoRA adapter (SGLang's route)", "unloadLoraAdapterSglang", "UnloadLoraAdapterRequest",
        ref("LoraAdapterUpdate"), (400, 401, 404, 500, 503))),
    Endpoint("/docs", "GET", docs_page, op.probe("Swagger UI over this document", "docs", _HTML), open=True),
    Endpoint(DOCS_INIT, "GET", docs_init, op.probe("The Swagger UI page's start-up script", "docsInit", _SCRIPT),
             open=True),
)
