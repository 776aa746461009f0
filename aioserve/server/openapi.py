"""GET /openapi.json: an OpenAPI 3.1 description of every endpoint.

Request and response schemas are generated from the pydantic models the
handlers themselves use, so the document cannot drift from the code; a few
adjustments make the schemas say what the wire actually carries:

* requests: an explicit null means "the default" (RequestModel drops nulls
  before validation), so every optional field also accepts null;
* responses: a WireModel writes every field except those in its
  `omit_when_none`, so all the others are required; and it writes a
  non-finite float (a -inf logprob) as null, so every number may be null.

The document depends on no runtime state: it is built on the first request
and cached for the life of the process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.generate_protocol import GenerateBatch, GenerateOutput, GenerateRequest
from aioserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestModel,
    TokenizeRequest,
)
from aioserve.server.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    DetokenizeResponse,
    ErrorResponse,
    FlushCacheResponse,
    ModelCard,
    ModelList,
    ServerInfo,
    TokenizeResponse,
)
from aioserve.server.wire import WireModel
from aioserve.server.worker_routes import ModelInfo, VersionInfo, WorkerLoad

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{model}"
JsonDict = dict[str, Any]


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, GenerateRequest, TokenizeRequest, DetokenizeRequest,
)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    Completion, ChatCompletion, ChatCompletionChunk, ModelList, ModelCard, GenerateOutput, GenerateBatch,
    ErrorResponse, TokenizeResponse, DetokenizeResponse, FlushCacheResponse, ServerInfo,
    ModelInfo, WorkerLoad, VersionInfo,
)
# The request and the response each have a class named ChatMessage; the
# response's takes OpenAI's name for it, so both keep a short name.
RESPONSE_RENAMES = {"ChatMessage": "ChatCompletionMessage"}


# -- schemas ---------------------------------------------------------------------------


def _nested_models(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    """`model` and every model its fields' annotations name, recursively."""
    seen: set[type[BaseModel]] = set()
    stack: list[Any] = [model]
    while stack:
        item = stack.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            if item in seen:
                continue
            seen.add(item)
            yield item
            stack.extend(field.annotation for field in item.model_fields.values())
        else:
            stack.extend(typing.get_args(item))


def _models_by_name(models: tuple[type[BaseModel], ...]) -> dict[str, type[BaseModel]]:
    found: dict[str, type[BaseModel]] = {}
    for top in models:
        for model in _nested_models(top):
            other = found.setdefault(model.__name__, model)
            # Pydantic would name both by their module path: say so here instead.
            assert other is model, f"two schema models named {model.__name__}: add one to the renames"
    return found


def _generate(models: tuple[type[BaseModel], ...]) -> JsonDict:
    _, top = models_json_schema([(model, "validation") for model in models], ref_template=REF_TEMPLATE)
    return top.get("$defs", {})


def _accepts_null(schema: JsonDict) -> bool:
    return schema.get("type") == "null" or any(_accepts_null(option) for option in schema.get("anyOf", []))


def _null_means_default(schema: JsonDict) -> None:
    """Optional request fields accept an explicit null (RequestModel drops it)."""
    required = set(schema.get("required", []))
    for name, field in schema.get("properties", {}).items():
        if name in required or _accepts_null(field):
            continue
        annotations = {key: field.pop(key) for key in ("title", "description", "default") if key in field}
        schema["properties"][name] = {"anyOf": [field, {"type": "null"}], **annotations}


def _wire_required(schema: JsonDict, model: type[WireModel]) -> None:
    """Every field a WireModel writes is required: all but omit_when_none."""
    schema["required"] = [
        field.alias or name for name, field in model.model_fields.items() if name not in model.omit_when_none
    ]


def _numbers_may_be_null(node: Any) -> None:
    """WireModel writes inf and nan as null (ser_json_inf_nan)."""
    if isinstance(node, list):
        for item in node:
            _numbers_may_be_null(item)
    elif isinstance(node, dict):
        if node.get("type") == "number":
            node["type"] = ["number", "null"]
        for value in node.values():
            _numbers_may_be_null(value)


def _renamed(node: Any, renames: dict[str, str]) -> Any:
    """`node` with every $ref to a renamed schema pointing at its new name."""
    if isinstance(node, list):
        return [_renamed(item, renames) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _renamed(value, renames) for key, value in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith(REF_TEMPLATE.format(model="")):
        name = ref.rsplit("/", 1)[1]
        out["$ref"] = REF_TEMPLATE.format(model=renames.get(name, name))
    return out


def request_schemas() -> JsonDict:
    defs = _generate(REQUEST_MODELS)
    for name, model in _models_by_name(REQUEST_MODELS).items():
        if issubclass(model, RequestModel):
            _null_means_default(defs[name])
    return defs


def response_schemas() -> JsonDict:
    defs = _generate(RESPONSE_MODELS)
    for name, model in _models_by_name(RESPONSE_MODELS).items():
        if issubclass(model, WireModel):
            _wire_required(defs[name], model)
            _numbers_may_be_null(defs[name])
    defs = _renamed(defs, RESPONSE_RENAMES)
    for old, new in RESPONSE_RENAMES.items():
        defs[new] = defs.pop(old)
        defs[new]["title"] = new
    return defs


def all_schemas() -> JsonDict:
    requests, responses = request_schemas(), response_schemas()
    clash = set(requests) & set(responses)
    assert not clash, f"request and response schemas share names: {sorted(clash)}"
    return dict(sorted({**requests, **responses}.items()))


# -- paths -----------------------------------------------------------------------------


def ref(name: str) -> JsonDict:
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _json_content(schema: JsonDict) -> JsonDict:
    return {"application/json": {"schema": schema}}


def _error(description: str, retry: bool = False) -> JsonDict:
    response: JsonDict = {"description": description, "content": _json_content(ref("ErrorResponse"))}
    if retry:
        response["headers"] = {
            "Retry-After": {"description": "Seconds to wait before trying again.", "schema": {"type": "integer"}}
        }
    return response


ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of range; `error.param` names the field.",
    401: "Missing or wrong API key (only when the server runs with --api-key or AIOSERVE_API_KEY).",
    404: "The model named is not the one this server serves (`error.code` model_not_found).",
    413: "The request body is larger than --max-request-bytes.",
    429: "Too many requests are waiting for admission (--max-waiting-requests).",
    500: "An internal error (the server logs its traceback).",
    503: "The server is shutting down: running requests finish, new ones are refused.",
}


def _errors(*statuses: int) -> JsonDict:
    return {str(status): _error(ERROR_DESCRIPTIONS[status], retry=status in (429, 503)) for status in statuses}


POST_ERRORS = (400, 401, 404, 413, 500, 503)
GENERATING_ERRORS = (*POST_ERRORS, 429)


def _generating(summary: str, operation_id: str, body: str, whole: JsonDict, chunk: JsonDict) -> JsonDict:
    """A generating endpoint: one JSON body, or with `stream: true` an SSE stream."""
    return {
        "post": {
            "summary": summary,
            "operationId": operation_id,
            "requestBody": {"required": True, "content": _json_content(ref(body))},
            "responses": {
                "200": {
                    "description": (
                        "The whole result as JSON; or, with `stream: true`, server-sent events: each "
                        "`data:` line holds one chunk of the text/event-stream schema (an ErrorResponse "
                        "if generation fails midway) and the stream ends with `data: [DONE]`."
                    ),
                    "content": {
                        **_json_content(whole),
                        "text/event-stream": {"schema": {"anyOf": [chunk, ref("ErrorResponse")]}},
                    },
                },
                **_errors(*GENERATING_ERRORS),
            },
        }
    }


def _get(summary: str, operation_id: str, schema: JsonDict, errors: tuple[int, ...] = (401, 500, 503)) -> JsonDict:
    return {
        "get": {
            "summary": summary,
            "operationId": operation_id,
            "responses": {"200": {"description": "OK", "content": _json_content(schema)}, **_errors(*errors)},
        }
    }


def _post(summary: str, operation_id: str, body: str | None, schema: JsonDict, errors: tuple[int, ...]) -> JsonDict:
    operation: JsonDict = {
        "summary": summary,
        "operationId": operation_id,
        "responses": {"200": {"description": "OK", "content": _json_content(schema)}, **_errors(*errors)},
    }
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _json_content(ref(body))}
    return {"post": operation}


# Probes and scrapers get no API key: these say so by an empty security list.
OPEN: JsonDict = {"security": []}


def paths() -> JsonDict:
    model_card = _get("The served model", "retrieveModel", ref("ModelCard"), (401, 404, 500, 503))
    model_card["get"]["parameters"] = [
        {
            "name": "model",
            "in": "path",
            "required": True,
            "description": "The served model's name; it may hold slashes (Qwen/Qwen3-0.6B).",
            "schema": {"type": "string"},
        }
    ]
    return {
        "/v1/completions": _generating(
            "OpenAI completions", "createCompletion", "CompletionRequest", ref("Completion"), ref("Completion")
        ),
        "/v1/chat/completions": _generating(
            "OpenAI chat completions", "createChatCompletion", "ChatCompletionRequest",
            ref("ChatCompletion"), ref("ChatCompletionChunk"),
        ),
        "/v1/models": _get("The served model, as a list", "listModels", ref("ModelList")),
        "/v1/models/{model}": model_card,
        "/generate": _generating(
            "SGLang's native generate (one output, or a list for a batch or n > 1)", "generate",
            "GenerateRequest", {"anyOf": [ref("GenerateOutput"), ref("GenerateBatch")]}, ref("GenerateOutput"),
        ),
        "/health": {
            "get": {
                "summary": "200 while the server can serve; 503 while it shuts down or once its scheduler has stopped",
                "operationId": "health",
                **OPEN,
                "responses": {"200": {"description": "Healthy (empty body)"}, "503": {"description": "Unhealthy"}},
            }
        },
        "/tokenize": _post("Tokenize a prompt or chat messages", "tokenize", "TokenizeRequest",
                           ref("TokenizeResponse"), POST_ERRORS),
        "/detokenize": _post("Decode token ids", "detokenize", "DetokenizeRequest",
                             ref("DetokenizeResponse"), POST_ERRORS),
        "/flush_cache": _post("Empty the prefix cache (400 while requests run)", "flushCache", None,
                              ref("FlushCacheResponse"), (400, 401, 500, 503)),
        "/server_info": _get("Configuration, KV pool occupancy, scheduler counters", "serverInfo", ref("ServerInfo")),
        # SGLang's worker endpoints, for a router in front of replicas (server/worker_routes.py).
        "/get_server_info": _get("/server_info under SGLang's older name", "getServerInfo", ref("ServerInfo")),
        "/model_info": _get("The model, in SGLang's fields", "modelInfo", ref("ModelInfo")),
        "/get_model_info": _get("/model_info under SGLang's older name", "getModelInfo", ref("ModelInfo")),
        "/get_load": _get("Requests and KV tokens held, as SGLang's list (one entry)", "getLoad",
                          {"type": "array", "items": ref("WorkerLoad")}),
        "/health_generate": {
            "get": {
                "summary": "200 once a one-token generation came back; 503 if it failed or the server is unhealthy",
                "operationId": "healthGenerate",
                "responses": {"200": {"description": "Healthy (empty body)"}, "503": {"description": "Unhealthy"},
                              **_errors(401)},
            }
        },
        "/version": _get("The aioserve version", "version", ref("VersionInfo")),
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "operationId": "metrics",
                **OPEN,
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": _get("This document", "openapi", {"type": "object"}),
    }


# -- the document ------------------------------------------------------------------------


def _version() -> str:
    """The installed distribution's version (the package root is above this module)."""
    try:
        return importlib.metadata.version("aioserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@cache
def _document_bytes(secured: bool) -> bytes:
    """With an API key, the bearer scheme applies to every route but the
    open ones; without one, the document declares no security at all."""
    document: dict = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "aioserve",
            "version": _version(),
            "description": "OpenAI-compatible (and SGLang /generate) LLM inference server.",
        },
        "paths": paths(),
        "components": {"schemas": all_schemas()},
    }
    if secured:
        document["components"]["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "the server's --api-key (or AIOSERVE_API_KEY)"}
        }
        document["security"] = [{"apiKey": []}]
    return json.dumps(document).encode()


async def openapi_json(request: Request) -> Response:
    ctx = getattr(request.app.state, "ctx", None)
    secured = bool((ctx is not None and ctx.args.api_key) or os.environ.get("AIOSERVE_API_KEY"))
    return Response(_document_bytes(secured), media_type="application/json")

