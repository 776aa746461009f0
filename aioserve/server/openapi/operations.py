"""OpenAPI operation objects for the route table (endpoints/routes.py):
what each kind of endpoint takes and answers, its errors included."""

from __future__ import annotations

from typing import Any

from aioserve.server.openapi.schemas import REF_TEMPLATE

JsonDict = dict[str, Any]


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
GET_ERRORS = (401, 500, 503)


def generating(summary: str, operation_id: str, body: str, whole: JsonDict, chunk: JsonDict) -> JsonDict:
    """A generating endpoint: one JSON body, or with `stream: true` an SSE stream."""
    return {
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


def get(summary: str, operation_id: str, schema: JsonDict, errors: tuple[int, ...] = GET_ERRORS) -> JsonDict:
    return {
        "summary": summary,
        "operationId": operation_id,
        "responses": {"200": {"description": "OK", "content": _json_content(schema)}, **_errors(*errors)},
    }


def post(summary: str, operation_id: str, body: str | None, schema: JsonDict, errors: tuple[int, ...]) -> JsonDict:
    operation = get(summary, operation_id, schema, errors)
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _json_content(ref(body))}
    return operation


def post_text(summary: str, operation_id: str, body: str, errors: tuple[int, ...]) -> JsonDict:
    """A POST answered in plain text (vLLM's LoRA routes)."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "summary": summary,
        "operationId": operation_id,
        "requestBody": {"required": True, "content": _json_content(ref(body))},
        "responses": {"200": {"description": "OK", "content": text}, **_errors(*errors)},
    }


def with_path_parameter(operation: JsonDict, name: str, description: str) -> JsonDict:
    parameter = {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}
    return {**operation, "parameters": [parameter]}


def status_only(summary: str, operation_id: str, responses: JsonDict, errors: tuple[int, ...] = ()) -> JsonDict:
    """An endpoint that answers by its status alone."""
    return {"summary": summary, "operationId": operation_id, "responses": {**responses, **_errors(*errors)}}


def probe(summary: str, operation_id: str, responses: JsonDict) -> JsonDict:
    """An open endpoint (probes and scrapers get no API key): an empty security list says so."""
    return {**status_only(summary, operation_id, responses), "security": []}
