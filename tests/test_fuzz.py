"""A bounded fuzz run (about 60 s) against one tiny server.

Bodies for /v1/completions, /v1/chat/completions, /generate and /tokenize
are drawn by hypothesis from the request schemas the server itself
publishes at /openapi.json (so a field added to a pydantic model is fuzzed
without touching this file), then some are spoiled: a field replaced by
arbitrary JSON, a required field dropped, or the whole body replaced.
Generation-length fields are bounded so that every valid request is quick.

For every answer: no 5xx, every 4xx in the OpenAI error shape, every 200
(body or each SSE event) valid against its schema in /openapi.json. At the
end the server is healthy, idle, and its KV bookkeeping intact.

derandomize=True: CI draws the same cases every run. AIOSERVE_FUZZ_EXAMPLES
and AIOSERVE_FUZZ_SECONDS change the budget (the time limit stops sending
once spent, whatever max_examples says).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from server_harness import RunningServer, start_server  # noqa: E402
from test_openapi_endpoint import OpenAPIDocument  # noqa: E402

# ~450 requests fit in 60 s on two cores shared with other test runs.
EXAMPLES = int(os.environ.get("AIOSERVE_FUZZ_EXAMPLES", "400"))
SECONDS = float(os.environ.get("AIOSERVE_FUZZ_SECONDS", "60"))
VOCAB = 328  # the tiny checkpoint's vocabulary (tests/tiny_models.py); ids past it are drawn too

ENDPOINTS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/generate": "GenerateRequest",
    "/tokenize": "TokenizeRequest",
}

# Fields that decide how much work a valid request is: kept small so that
# hundreds of requests fit in a minute on two loaded cores. The spoiling
# step below still puts arbitrary values in them.
SMALL_INTS = {
    "max_tokens": (0, 6), "max_completion_tokens": (1, 6), "max_new_tokens": (0, 6), "n": (1, 3),
    "min_tokens": (0, 3), "min_new_tokens": (0, 3), "logprobs": (0, 5), "top_logprobs": (0, 5),
    "top_logprobs_num": (0, 5), "logprob_start_len": (-1, 4), "top_k": (-1, 50),
}
MAX_LIST = 3
MAX_TEXT = 24
SERVED = "tiny-fuzz"
# Drawn from the schema, `model` is almost never the served name: every
# request would be a 404. The spoiling step still sends arbitrary names.
NAMED = {
    "model": st.sampled_from([SERVED, SERVED, SERVED, "not-served"]),
    # Keys spelling token ids (some past the vocabulary), values around the allowed [-100, 100].
    "logit_bias": st.dictionaries(
        st.integers(min_value=-2, max_value=VOCAB + 10).map(str), st.floats(min_value=-120, max_value=120), max_size=3
    ),
}
# Hypothesis favours empty strings and lists, and an empty prompt is only
# ever a 400: these fields are drawn non-empty (the spoiling step empties some).
NON_EMPTY = frozenset({"prompt", "text", "input_ids", "content"})
# A random regex, grammar, JSON schema, tool list or structural tag is
# refused nearly always, and each is optional: a body drawn from the whole
# schema is almost never valid. Half the bodies keep to these fields, which
# random values satisfy often enough to reach generation (and its 200s).
CORE_FIELDS = frozenset({
    "model", "prompt", "messages", "role", "content", "type", "text", "name", "input_ids", "tokens",
    "sampling_params", "max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens",
    "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "seed", "sampling_seed", "ignore_eos",
    "stream", "stream_options", "include_usage", "logprobs", "top_logprobs", "echo", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
    "no_stop_trim", "return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "rid",
    "add_special_tokens", "add_generation_prompt", "user",
})

# 5xx answers that are known product bugs (reported; see tests/test_bad_requests.py),
# recognised by their message. Remove an entry once its bug is fixed.
KNOWN_5XX: dict[str, str] = {}  # message signature -> bug, for a 5xx found and not fixed yet


# -- strategies from JSON Schema (the subset pydantic writes) --------------------------------

JSON_LEAF = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=MAX_TEXT)
)
GARBAGE = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=MAX_LIST) | st.dictionaries(st.text(max_size=8), inner, max_size=MAX_LIST),
    max_leaves=8,
)


def _integers(schema: dict[str, Any], name: str | None) -> st.SearchStrategy[int]:
    if name in SMALL_INTS:
        low, high = SMALL_INTS[name]
        return st.integers(min_value=low, max_value=high)
    low = schema.get("minimum", -3)
    if "exclusiveMinimum" in schema:
        low = math.floor(schema["exclusiveMinimum"]) + 1
    high = schema.get("maximum", max(low, 0) + VOCAB + 10)  # token ids mostly, some past the vocabulary
    return st.integers(min_value=low, max_value=high)


def _numbers(schema: dict[str, Any]) -> st.SearchStrategy[float]:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    return st.floats(
        min_value=low, max_value=high, allow_nan=False, allow_infinity=False,
        exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
    )


def _strings(schema: dict[str, Any], name: str | None) -> st.SearchStrategy[str]:
    low = max(schema.get("minLength", 0), 1 if name in NON_EMPTY else 0)
    return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", MAX_TEXT), MAX_TEXT)))


class SchemaStrategies:
    """Hypothesis strategies for the schemas of one /openapi.json document."""

    def __init__(self, document: dict[str, Any], keep: frozenset[str] | None = None) -> None:
        self.schemas = document["components"]["schemas"]
        self.keep = keep  # only these properties of any object (None: all)

    def named(self, name: str) -> st.SearchStrategy[Any]:
        return st.deferred(lambda: self.build(self.schemas[name]))

    def build(self, schema: dict[str, Any] | bool, name: str | None = None) -> st.SearchStrategy[Any]:
        if schema is True or schema == {}:
            return GARBAGE
        assert isinstance(schema, dict), schema
        if name in NAMED:
            return NAMED[name]
        if "$ref" in schema:
            return self.named(schema["$ref"].rsplit("/", 1)[1])
        if "anyOf" in schema or "oneOf" in schema:  # oneOf: a discriminated union (chat's content parts)
            return st.one_of([self.build(option, name) for option in schema.get("anyOf", schema.get("oneOf"))])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.build({**schema, "type": one}, name) for one in kind])
        return self._typed(schema, kind, name)

    def _typed(self, schema: dict[str, Any], kind: str | None, name: str | None) -> st.SearchStrategy[Any]:
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            return _integers(schema, name)
        if kind == "number":
            return _numbers(schema)
        if kind == "string":
            return _strings(schema, name)
        if kind == "array":
            return self._array(schema, name)
        if kind == "object":
            return self._object(schema)
        return GARBAGE

    def _array(self, schema: dict[str, Any], name: str | None) -> st.SearchStrategy[list[Any]]:
        if "prefixItems" in schema:
            return st.tuples(*(self.build(item) for item in schema["prefixItems"])).map(list)
        low = max(schema.get("minItems", 0), 1 if name in NON_EMPTY else 0)
        return st.lists(self.build(schema.get("items", True), name), min_size=low, max_size=max(low, MAX_LIST))

    def _object(self, schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        properties = schema.get("properties")
        if not properties:  # dict[str, X]: logit_bias, chat_template_kwargs, JSON schemas
            values = schema.get("additionalProperties", True)
            return st.dictionaries(st.text(max_size=8), self.build(values), max_size=MAX_LIST)
        required = set(schema.get("required", []))
        if self.keep is not None:
            properties = {key: value for key, value in properties.items() if key in required or key in self.keep}
        return st.fixed_dictionaries(
            {key: self.build(value, key) for key, value in properties.items() if key in required},
            optional={key: self.build(value, key) for key, value in properties.items() if key not in required},
        )


@st.composite
def spoiled(draw: st.DrawFn, body: dict[str, Any]) -> Any:
    """The body as drawn (most often), or made invalid in one of a few ways."""
    how = draw(st.sampled_from(["keep", "keep", "keep", "replace-field", "drop-field", "add-field", "replace-body"]))
    if how == "replace-field" and body:
        body = {**body, draw(st.sampled_from(sorted(body))): draw(GARBAGE)}
    elif how == "drop-field" and body:
        dropped = draw(st.sampled_from(sorted(body)))
        body = {key: value for key, value in body.items() if key != dropped}
    elif how == "add-field":
        body = {**body, draw(st.text(min_size=1, max_size=8)): draw(GARBAGE)}
    elif how == "replace-body":
        return draw(GARBAGE)
    return body


def cases(document: dict[str, Any]) -> st.SearchStrategy[tuple[str, Any]]:
    every_field, core = SchemaStrategies(document), SchemaStrategies(document, keep=CORE_FIELDS)
    per_endpoint = [
        st.tuples(st.just(path), (every_field.named(schema) | core.named(schema)).flatmap(spoiled))
        for path, schema in ENDPOINTS.items()
    ]
    return st.one_of(per_endpoint)


# -- the run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_checkpoints: dict[str, Path]):
    started = start_server(
        tiny_checkpoints["llama"], "--served-model-name", SERVED, "--page-size", "4", "--num-pages", "2048",
        "--debug-integrity",
    )
    yield started
    started.stop()


@pytest.fixture(scope="module")
def document(server: RunningServer) -> dict[str, Any]:
    return httpx.get(f"{server.url}/openapi.json", timeout=30).json()


def check_answer(
    spec: OpenAPIDocument, path: str, body: Any, response: httpx.Response, known: Counter, refused: Counter
) -> None:
    status = response.status_code
    sent = json.dumps(body)[:600]
    if status >= 500:
        message = response.text
        bug = next((name for signature, name in KNOWN_5XX.items() if signature in message), None)
        assert bug is not None, f"{status} for POST {path} {sent}\n{message[:600]}"
        known[bug] += 1
        return
    if status >= 400:  # the schema check below sees the fields; this, that nothing else is there
        assert set(response.json()) == {"error"}, response.text[:600]
        refused[response.json()["error"]["param"]] += 1
    assert status in (200, 400, 404, 413), f"{status} for POST {path} {sent}\n{response.text[:600]}"
    spec.check(response, path)


def test_fuzz_requests(server: RunningServer, document: dict[str, Any]) -> None:
    spec = OpenAPIDocument(document)
    client = httpx.Client(base_url=server.url, timeout=120)
    statuses: Counter = Counter()
    known: Counter = Counter()
    refused: Counter = Counter()  # error.param of the 4xx answers: what the run mostly trips on
    started = time.monotonic()

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(case=cases(document))
    def one_request(case: tuple[str, Any]) -> None:
        if time.monotonic() - started > SECONDS:
            statuses["not sent (time budget spent)"] += 1
            return
        path, body = case
        response = client.post(path, json=body)
        statuses[response.status_code] += 1
        check_answer(spec, path, body, response, known, refused)

    try:
        one_request()
    finally:
        client.close()
        elapsed = time.monotonic() - started
        sent = sum(count for key, count in statuses.items() if isinstance(key, int))
        print(f"\nfuzz: {sent} requests sent in {elapsed:.1f}s; statuses {dict(statuses)}")
        print(f"fuzz: known 5xx bugs met {dict(known)}")
        print(f"fuzz: most refused params {refused.most_common(12)}")
    info = server.wait_idle(timeout=60.0)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert info["kv_integrity"] == "ok", info["kv_integrity"]
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"], info
    assert sent >= min(EXAMPLES, 50), "the fuzz run sent too few requests to mean anything"
