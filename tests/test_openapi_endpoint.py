"""GET /openapi.json: the document is well-formed OpenAPI 3.1, names every
route the app serves, and the server's real responses (bodies, stream
chunks, errors) validate against the schemas it gives for them.

`OpenAPIDocument` is also what tests/test_fuzz.py checks its responses with.
"""

from __future__ import annotations

import json
import re
from functools import cache
from unittest.mock import MagicMock
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from starlette.routing import Route
from starlette.testclient import TestClient

from aioserve.config import EngineConfig, ServerArgs
from aioserve.server.endpoints.app import create_app

DOCUMENT_URI = "urn:aioserve-openapi"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# The chat page, its files and its config are for browsers, not API clients.
NOT_API = {"/", "/page-config"}

# What OpenAPI 3.1 asks of the parts of a document this server writes (no
# openapi-spec-validator in the test dependencies): enough to catch a
# response without a description, a bad status key or an undeclared path
# parameter.
OPENAPI_SKELETON: dict[str, Any] = {
    "type": "object",
    "required": ["openapi", "info", "paths"],
    "properties": {
        "openapi": {"type": "string", "pattern": r"^3\.1\.\d+$"},
        "info": {
            "type": "object",
            "required": ["title", "version"],
            "properties": {"title": {"type": "string"}, "version": {"type": "string"}},
        },
        "paths": {
            "type": "object",
            "propertyNames": {"pattern": "^/"},
            "additionalProperties": {"$ref": "#/$defs/pathItem"},
        },
        "components": {
            "type": "object",
            "properties": {
                "schemas": {"type": "object", "additionalProperties": {"type": ["object", "boolean"]}},
                "securitySchemes": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"enum": ["apiKey", "http", "mutualTLS", "oauth2", "openIdConnect"]}},
                    },
                },
            },
        },
        "security": {"$ref": "#/$defs/security"},
    },
    "$defs": {
        "pathItem": {
            "type": "object",
            "propertyNames": {"enum": [*HTTP_METHODS, "summary", "description", "parameters", "servers", "$ref"]},
            "properties": {method: {"$ref": "#/$defs/operation"} for method in HTTP_METHODS},
        },
        "operation": {
            "type": "object",
            "required": ["responses"],
            "properties": {
                "operationId": {"type": "string"},
                "parameters": {"type": "array", "items": {"$ref": "#/$defs/parameter"}},
                "requestBody": {
                    "type": "object",
                    "required": ["content"],
                    "properties": {"content": {"$ref": "#/$defs/content"}},
                },
                "responses": {
                    "type": "object",
                    "minProperties": 1,
                    "propertyNames": {"pattern": r"^([1-5](\d\d|XX)|default)$"},
                    "additionalProperties": {"$ref": "#/$defs/response"},
                },
                "security": {"$ref": "#/$defs/security"},
            },
        },
        "parameter": {
            "type": "object",
            "required": ["name", "in"],
            "properties": {"name": {"type": "string"}, "in": {"enum": ["query", "header", "path", "cookie"]}},
            # A path parameter must say required: true.
            "if": {"properties": {"in": {"const": "path"}}},
            "then": {"required": ["required"], "properties": {"required": {"const": True}}},
        },
        "response": {
            "type": "object",
            "required": ["description"],
            "properties": {"description": {"type": "string"}, "content": {"$ref": "#/$defs/content"}},
        },
        "content": {
            "type": "object",
            "additionalProperties": {"type": "object", "properties": {"schema": {"type": ["object", "boolean"]}}},
        },
        "security": {
            "type": "array",
            "items": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
        },
    },
}


def _pointer(*parts: str) -> str:
    """A JSON pointer (RFC 6901) to `parts`."""
    return "/" + "/".join(part.replace("~", "~0").replace("/", "~1") for part in parts)


def _resolve(document: Any, pointer: str) -> Any:
    node = document
    for part in pointer.lstrip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [ref for item in node for ref in _refs(item)]
    if not isinstance(node, dict):
        return []
    own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    return own + [ref for value in node.values() for ref in _refs(value)]


def media_type(response: httpx.Response) -> str | None:
    header = response.headers.get("content-type")
    return header.split(";")[0].strip() if header else None


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, [DONE] included."""
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event]


class OpenAPIDocument:
    """/openapi.json as validators: one per (path, method, status, media type)."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.registry = Registry().with_resource(DOCUMENT_URI, DRAFT202012.create_resource(document))
        self._validators: dict[tuple[str, ...], Draft202012Validator] = {}

    def operation(self, path: str, method: str) -> dict[str, Any]:
        return self.document["paths"][path][method.lower()]

    def response(self, path: str, method: str, status: int) -> dict[str, Any]:
        responses = self.operation(path, method)["responses"]
        assert str(status) in responses, f"{method} {path} answered {status}, which the document does not list"
        return responses[str(status)]

    def validator(self, path: str, method: str, status: int, media: str) -> Draft202012Validator:
        key = (path, method.lower(), str(status), media)
        if key not in self._validators:
            content = self.response(path, method, status).get("content", {})
            assert media in content, f"{method} {path} {status}: {media} is not documented (only {list(content)})"
            # Through the document's URI, so that the schema's own
            # "#/components/..." references resolve against the document.
            where = _pointer("paths", path, method.lower(), "responses", str(status), "content", media, "schema")
            self._validators[key] = Draft202012Validator({"$ref": f"{DOCUMENT_URI}#{where}"}, registry=self.registry)
        return self._validators[key]

    def errors(self, body: Any, path: str, method: str, status: int, media: str = "application/json") -> list[str]:
        found = self.validator(path, method, status, media).iter_errors(body)
        return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}" for e in found]

    def check(self, response: httpx.Response, path: str) -> None:
        """`response` (to a request on the templated `path`) is documented:
        its status, its media type, and its body, or each event of its stream."""
        method, status, media = response.request.method, response.status_code, media_type(response)
        documented = self.response(path, method, status)
        if "content" not in documented:
            assert not response.content, f"{method} {path} {status}: undocumented body {response.text[:200]}"
            return
        if media == "text/event-stream":
            events = sse_events(response.text)
            assert events and events[-1] == "[DONE]", f"{path}: stream without [DONE]: {response.text[-300:]}"
            for event in events[:-1]:
                errors = self.errors(json.loads(event), path, method, status, media)
                assert not errors, f"{method} {path} stream event: {errors[:5]}\n{event[:1000]}"
        elif media == "application/json":
            errors = self.errors(response.json(), path, method, status, media)
            assert not errors, f"{method} {path} {status}: {errors[:5]}\n{response.text[:1000]}"
        else:
            self.validator(path, method, status, media or "")  # the media type at least is documented


@cache
def _app_routes() -> list[Route]:
    """The routes of an app built in this process (its handlers are not run)."""
    app = create_app(fake_context(ServerArgs(engine=EngineConfig())))
    return [route for route in app.routes if isinstance(route, Route)]


def fake_context(args: ServerArgs) -> Any:
    """Enough of a ServingContext to build the app: real arguments, and a
    stand-in for everything else (scheduler, tokenizer, metrics), which only
    handlers would use."""
    ctx = MagicMock()
    ctx.args = args
    ctx.draining = False  # a MagicMock attribute is truthy: the app would answer 503 to everything
    return ctx


def _template(path: str) -> str:
    """starlette's "{model:path}" is OpenAPI's "{model}"."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def document(chat_server) -> dict[str, Any]:
    response = httpx.get(f"{chat_server.url}/openapi.json", timeout=30)
    assert response.status_code == 200, response.text
    assert media_type(response) == "application/json"
    return response.json()


@pytest.fixture(scope="module")
def spec(document: dict[str, Any]) -> OpenAPIDocument:
    return OpenAPIDocument(document)


@pytest.fixture(autouse=True)
def kv_intact_after_each_test(chat_server):
    yield
    info = chat_server.wait_idle(timeout=30.0)
    assert info["kv_integrity"] == "ok"
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"]


# -- the document itself ----------------------------------------------------------------------


def test_document_has_openapi_31_structure(document: dict[str, Any]) -> None:
    found = Draft202012Validator(OPENAPI_SKELETON).iter_errors(document)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in found]
    assert not errors, errors[:10]
    operation_ids = [
        operation["operationId"]
        for item in document["paths"].values()
        for method, operation in item.items()
        if method in HTTP_METHODS
    ]
    assert len(operation_ids) == len(set(operation_ids)), "operationIds must be unique"


def test_every_schema_is_valid_json_schema(document: dict[str, Any]) -> None:
    for name, schema in document["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)  # raises, naming the fault
        assert schema.get("title"), name


def test_every_ref_resolves(document: dict[str, Any]) -> None:
    refs = set(_refs(document))
    assert refs, "no $ref at all: the schemas were inlined?"
    for ref in refs:
        assert ref.startswith("#/"), f"{ref}: only local references are expected"
        try:
            _resolve(document, ref[1:])
        except (KeyError, IndexError, ValueError):
            pytest.fail(f"{ref} does not resolve")


def test_path_parameters_are_declared(document: dict[str, Any]) -> None:
    for path, item in document["paths"].items():
        wanted = set(re.findall(r"\{(\w+)\}", path))
        for method, operation in item.items():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert declared == wanted, f"{method} {path}: declares {declared}, template has {wanted}"


def test_every_route_of_the_app_is_documented(document: dict[str, Any]) -> None:
    api_routes = [route for route in _app_routes() if route.path not in NOT_API]
    assert len(api_routes) >= 12
    for route in api_routes:
        path = _template(route.path)
        assert path in document["paths"], f"{path} is served but not documented"
        for method in route.methods or ():
            if method != "HEAD":  # starlette adds HEAD to every GET
                assert method.lower() in document["paths"][path], f"{method} {path} is not documented"
    served = {_template(route.path) for route in api_routes}
    assert set(document["paths"]) <= served, f"documented but not served: {set(document['paths']) - served}"


def test_errors_and_streams_are_described(document: dict[str, Any]) -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"):
        responses = document["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413", "500"):
            assert responses[status]["content"]["application/json"]["schema"] == error_ref, (path, status)
    chunk = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert {"$ref": "#/components/schemas/ChatCompletionChunk"} in chunk["schema"]["anyOf"]
    request = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert request == {"$ref": "#/components/schemas/CompletionRequest"}


def test_open_routes_need_no_key(document: dict[str, Any]) -> None:
    assert "security" not in document  # no --api-key here (tests/test_auth.py checks the other case)
    for path in ("/health", "/metrics"):
        assert document["paths"][path]["get"]["security"] == []


def test_request_schemas_accept_null_for_optional_fields(spec: OpenAPIDocument) -> None:
    """RequestModel reads an explicit null as the default; the schema must agree."""
    body = {"prompt": "hi", "n": None, "max_tokens": None, "temperature": None, "stream": None}
    schema = {"$ref": f"{DOCUMENT_URI}#/components/schemas/CompletionRequest"}
    validator = Draft202012Validator(schema, registry=spec.registry)
    assert not list(validator.iter_errors(body))
    assert list(validator.iter_errors({"prompt": None})), "a required field stays non-null"


def test_ranges_come_from_the_one_table(document: dict[str, Any]) -> None:
    """Each route's request model declares the ranges aioserve/sampling_limits.py
    gives that route: OpenAI's temperature for OpenAI's routes, the engine's for /generate."""
    from aioserve.sampling_limits import GENERATE_BOUNDS, OPENAI_BOUNDS

    schemas = document["components"]["schemas"]

    def maximum(model: str, field: str) -> float:
        (bounded,) = [option for option in schemas[model]["properties"][field]["anyOf"] if option.get("type") != "null"]
        return bounded["maximum"]

    for model in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        assert maximum(model, "temperature") == OPENAI_BOUNDS["temperature"].high == 2
    assert maximum("GenerateSamplingParams", "temperature") == GENERATE_BOUNDS["temperature"].high == 100
    assert maximum("GenerateSamplingParams", "presence_penalty") == maximum("CompletionRequest", "presence_penalty") == 2


def test_the_openapi_spec_validator_accepts_it(document: dict[str, Any]) -> None:
    validators = pytest.importorskip("openapi_spec_validator", reason="openapi-spec-validator not installed")
    validators.validate(document)


def test_the_document_is_open_like_the_page_that_reads_it() -> None:
    """Under --api-key /docs and /openapi.json both answer without the key
    (vLLM keeps both public): Swagger UI loads, and its calls carry the key."""
    client = TestClient(create_app(fake_context(ServerArgs(engine=EngineConfig(), api_key="sesame"))))
    document = client.get("/openapi.json")
    assert document.status_code == 200 and document.json()["openapi"].startswith("3.1")
    assert document.json()["security"] == [{"apiKey": []}]  # the API it describes still wants the key
    assert client.get("/docs").status_code == 200
    assert client.get("/v1/models").status_code == 401


def test_the_document_is_built_once(chat_server) -> None:
    from aioserve.server.endpoints import routes

    first = httpx.get(f"{chat_server.url}/openapi.json", timeout=30).content
    assert first == httpx.get(f"{chat_server.url}/openapi.json", timeout=30).content
    assert routes._document_bytes(False) is routes._document_bytes(False)  # cached, not rebuilt per call


# -- real responses against the document ----------------------------------------------------

MESSAGES = [{"role": "user", "content": "Say something."}]

# (path template, method, URL path, JSON body or None): each answer must match its schema.
EXCHANGES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("/v1/completions", "POST", "/v1/completions", {"prompt": "Once", "max_tokens": 4}),
    ("/v1/completions", "POST", "/v1/completions",
     {"prompt": ["Once", "Twice"], "max_tokens": 3, "n": 2, "logprobs": 2, "echo": True, "temperature": 0}),
    ("/v1/completions", "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("/v1/completions", "POST", "/v1/completions",
     {"prompt": "Once", "max_tokens": 4, "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
    ("/v1/chat/completions", "POST", "/v1/chat/completions",
     {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 3, "n": 2, "seed": 1}),
    ("/v1/chat/completions", "POST", "/v1/chat/completions",
     {"messages": MESSAGES, "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 1,
      "stream_options": {"include_usage": True}}),
    ("/generate", "POST", "/generate", {"text": "Once", "sampling_params": {"max_new_tokens": 4}}),
    ("/generate", "POST", "/generate",
     {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 3, "n": 2},
      "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True}),
    ("/generate", "POST", "/generate", {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/responses", "POST", "/v1/responses", {"input": "Say something.", "max_output_tokens": 4}),
    ("/v1/responses", "POST", "/v1/responses", {"input": MESSAGES, "max_output_tokens": 4, "stream": True}),
    ("/v1/models", "GET", "/v1/models", None),
    ("/v1/models/{model}", "GET", "/v1/models/tiny-chat", None),
    ("/tokenize", "POST", "/tokenize", {"prompt": "Once upon"}),
    ("/tokenize", "POST", "/tokenize", {"messages": MESSAGES}),
    ("/detokenize", "POST", "/detokenize", {"tokens": [5, 6, 7]}),
    ("/flush_cache", "POST", "/flush_cache", None),
    ("/server_info", "GET", "/server_info", None),
    ("/get_server_info", "GET", "/get_server_info", None),
    ("/model_info", "GET", "/model_info", None),
    ("/get_model_info", "GET", "/get_model_info", None),
    ("/get_load", "GET", "/get_load", None),
    ("/health_generate", "GET", "/health_generate", None),
    ("/version", "GET", "/version", None),
    ("/health", "GET", "/health", None),
    ("/metrics", "GET", "/metrics", None),
    ("/openapi.json", "GET", "/openapi.json", None),
    # Errors: each one's status and ErrorResponse body.
    ("/v1/completions", "POST", "/v1/completions", {"prompt": "Once", "temperature": 9}),
    ("/v1/completions", "POST", "/v1/completions", {"prompt": "Once", "model": "not-served"}),
    ("/v1/chat/completions", "POST", "/v1/chat/completions", {"messages": []}),
    ("/v1/models/{model}", "GET", "/v1/models/not/served", None),
    ("/generate", "POST", "/generate", {"sampling_params": {"max_new_tokens": 2}}),
    ("/tokenize", "POST", "/tokenize", {}),
    ("/detokenize", "POST", "/detokenize", {"tokens": [-1]}),
]


@pytest.mark.parametrize(("path", "method", "url", "body"), EXCHANGES, ids=[f"{e[1]} {e[2]}" for e in EXCHANGES])
def test_real_responses_match_the_document(
    chat_server, spec: OpenAPIDocument, path: str, method: str, url: str, body: dict[str, Any] | None
) -> None:
    response = httpx.request(method, f"{chat_server.url}{url}", json=body, timeout=60)
    assert response.status_code < 500, response.text
    spec.check(response, path)


def test_a_wrong_method_answers_in_the_error_shape(chat_server, spec: OpenAPIDocument) -> None:
    """405 is not per operation in the document, but its body is the one ErrorResponse."""
    response = httpx.get(f"{chat_server.url}/v1/completions", timeout=30)
    assert response.status_code == 405
    schema = {"$ref": f"{DOCUMENT_URI}#/components/schemas/ErrorResponse"}
    assert not list(Draft202012Validator(schema, registry=spec.registry).iter_errors(response.json()))


def test_the_checker_rejects_what_the_document_forbids(spec: OpenAPIDocument) -> None:
    """Guards the tests above against a schema that accepts anything."""
    good = {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
    assert not spec.errors(good, "/v1/completions", "POST", 200)
    assert spec.errors({**good, "choices": None}, "/v1/completions", "POST", 200)
    assert spec.errors({**good, "object": "chat.completion"}, "/v1/completions", "POST", 200)
    no_finish = {**good, "choices": [{"index": 0, "text": "x", "logprobs": None}]}
    assert spec.errors(no_finish, "/v1/completions", "POST", 200), "finish_reason is always written"
    assert spec.errors({"error": {"message": "m", "type": "t"}}, "/v1/completions", "POST", 400)
