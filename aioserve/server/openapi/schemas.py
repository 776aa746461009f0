"""The OpenAPI document's schemas, generated from the pydantic models the
handlers themselves use, so they cannot drift from the code; a few
adjustments make them say what the wire actually carries:

* requests: an explicit null means "the default" (RequestModel drops nulls
  before validation), so every optional field also accepts null;
* responses: a WireModel writes every field except those in its
  `omit_when_none`, so all the others are required; and it writes a
  non-finite float (a -inf logprob) as null, so every number may be null.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from aioserve.server.errors import ErrorResponse
from aioserve.server.intake.generate_request import GenerateRequest
from aioserve.server.intake.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from aioserve.server.intake.lora_requests import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from aioserve.server.intake.pooling_requests import EmbeddingRequest, RerankRequest, ScoreRequest
from aioserve.server.intake.request_model import RequestModel
from aioserve.server.intake.responses_request import ResponsesRequest
from aioserve.server.output.completion_bodies import ChatCompletion, ChatCompletionChunk, Completion
from aioserve.server.output.generate_bodies import GenerateBatch, GenerateOutput
from aioserve.server.output.pooling_bodies import EmbeddingList, RerankResponse, ScoreResponse
from aioserve.server.output.responses_api_bodies import ResponseObject
from aioserve.server.output.service_bodies import (
    DetokenizeResponse,
    FlushCacheResponse,
    LoraAdapterUpdate,
    ModelCard,
    ModelInfo,
    ModelList,
    ServerInfo,
    TokenizeResponse,
    VersionInfo,
    WorkerLoad,
)
from aioserve.server.wire import WireModel

REF_TEMPLATE = "#/components/schemas/{model}"
JsonDict = dict[str, Any]

REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, GenerateRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest,
    EmbeddingRequest, RerankRequest, ScoreRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest,
)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    Completion, ChatCompletion, ChatCompletionChunk, ModelList, ModelCard, GenerateOutput, GenerateBatch,
    ErrorResponse, TokenizeResponse, DetokenizeResponse, FlushCacheResponse, ServerInfo,
    ModelInfo, WorkerLoad, VersionInfo, ResponseObject, EmbeddingList, RerankResponse, ScoreResponse,
    LoraAdapterUpdate,
)
# The request and the response each have a class named ChatMessage; the
# response's takes OpenAI's name for it, so both keep a short name. The
# Responses API's response object takes OpenAI's name, which in the code
# would read as starlette's Response.
RESPONSE_RENAMES = {"ChatMessage": "ChatCompletionMessage", "ResponseObject": "Response",
                    "EmbeddingList": "CreateEmbeddingResponse"}


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


