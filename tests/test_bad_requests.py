"""A table of bad requests across every endpoint, each with the status,
`error.type` and `error.param` an OpenAI client should get, run against one
server started for this module. After each one the server must still be
healthy, idle, and its KV bookkeeping intact; a 4xx must not have reached
the scheduler at all.

Rows marked `bug=` are known product bugs (the expected values are the
correct behaviour, not today's): they run as non-strict xfails, so the
health and integrity checks still apply to them, and a fix turns them into
XPASS, the cue to drop the marker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_harness import RunningServer, start_server

INVALID = "invalid_request_error"
NOT_FOUND = "not_found_error"
# The fixture's body limit sits between the two long-input rows below: a
# 2,000,000-character prompt (~2.0 MB of JSON) must be read and refused by
# length (400), a 2 MiB (2,097,152-byte) body must be refused unread (413).
MAX_REQUEST_BYTES = 2_050_000
LONG_PROMPT = "a" * 2_000_000
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# Product bugs this table found, all fixed since; a row that finds a new one
# names it with `bug=` (a non-strict xfail) until it is fixed.
UNION_PARAM = SURROGATE = RECURSION = TOP_K_OVERFLOW = SUPERSCRIPT_KEY = None
TEMPLATE_KWARGS = TOKENIZE_EMPTY_MESSAGES = PAST_VOCAB = CHAT_LENGTH_PARAM = None


@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: Any = None  # sent as JSON (None: no body)
    param: str | None = None
    status: int = 400
    type: str = INVALID
    method: str = "POST"
    raw: bytes | None = None  # sent as is, instead of `body`
    content_type: str | None = "application/json"
    bug: str | None = None
    max_seconds: float | None = None  # the answer must come this fast


def completion(name: str, param: str | None, bug: str | None = None, **fields: Any) -> Bad:
    return Bad(name, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields}, param, bug=bug)


def chat(name: str, param: str | None, bug: str | None = None, **fields: Any) -> Bad:
    return Bad(name, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **fields}, param, bug=bug)


def generate(name: str, param: str | None, bug: str | None = None, **fields: Any) -> Bad:
    return Bad(name, "/generate", {"text": "hi", **fields}, param, bug=bug)


def sampling(name: str, param: str, bug: str | None = None, **params: Any) -> Bad:
    return Bad(name, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}},
               f"sampling_params.{param}", bug=bug)


def raw(name: str, path: str, data: bytes, content_type: str | None = "application/json", **kw: Any) -> Bad:
    return Bad(name, path, raw=data, content_type=content_type, **kw)


ROWS: list[Bad] = [
    # -- the body itself -----------------------------------------------------------------
    raw("not-json", "/v1/completions", b"{not json"),
    raw("empty-body", "/v1/completions", b""),
    raw("json-array", "/v1/completions", b"[1, 2]"),
    raw("json-null", "/v1/completions", b"null"),
    raw("json-string", "/generate", b'"hello"'),
    raw("truncated-json", "/v1/chat/completions", b'{"messages": [{"role": "user"'),
    raw("latin-1-body", "/v1/completions", '{"prompt": "h\u00e9"}'.encode("latin-1")),
    raw("text-plain", "/v1/completions", b'{"prompt": "hi"}', content_type="text/plain"),
    raw("form-post", "/v1/chat/completions", b"messages=hi", content_type="application/x-www-form-urlencoded"),
    raw("deep-nesting", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, bug=RECURSION),
    raw("nan-temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', param="temperature"),
    raw("inf-penalty", "/v1/completions", b'{"prompt": "hi", "presence_penalty": Infinity}', param="presence_penalty"),
    raw("surrogate-prompt", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}', param="prompt",
        bug=SURROGATE),
    raw("surrogate-message", "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 1}', param="messages.0.content", bug=SURROGATE),
    raw("surrogate-text", "/generate", b'{"text": "\\ud800"}', param="text", bug=SURROGATE),
    raw("surrogate-tokenize", "/tokenize", b'{"prompt": "\\ud800"}', param="prompt", bug=SURROGATE),
    Bad("oversized-body", "/v1/completions", {"prompt": "a" * (2 << 20)}, None, status=413),
    Bad("long-prompt", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt", max_seconds=2.0),
    Bad("long-messages", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        "messages", max_seconds=2.0),
    Bad("long-text", "/generate", {"text": LONG_PROMPT}, "text", max_seconds=2.0),
    # -- /v1/completions -------------------------------------------------------------------
    Bad("no-prompt", "/v1/completions", {"max_tokens": 2}, "prompt"),
    completion("prompt-number", "prompt", UNION_PARAM, prompt=5),
    completion("prompt-mixed-list", "prompt", UNION_PARAM, prompt=[1, "a"]),
    completion("prompt-empty-list", "prompt", prompt=[]),
    completion("prompt-empty-string", "prompt", prompt=""),
    completion("prompt-empty-in-batch", "prompt", prompt=[[5], []]),
    completion("prompt-id-negative", "prompt", prompt=[-1]),
    completion("prompt-id-past-vocab", "prompt", prompt=[5, 99_999]),
    completion("prompt-id-huge", "prompt", prompt=[2**70]),
    completion("prompt-over-context", "prompt", prompt=[5] * 1100),
    completion("max-tokens-string", "max_tokens", max_tokens="many"),
    completion("max-tokens-fraction", "max_tokens", max_tokens=1.5),
    completion("max-tokens-negative", "max_tokens", max_tokens=-1),
    completion("max-tokens-over-context", "max_tokens", max_tokens=2000),
    completion("n-zero", "n", n=0),
    completion("n-too-many", "n", n=129),
    completion("temperature-negative", "temperature", temperature=-1),
    completion("temperature-high", "temperature", temperature=2.5),
    completion("temperature-string", "temperature", temperature="hot"),
    completion("top-p-zero", "top_p", top_p=0),
    completion("top-p-high", "top_p", top_p=1.5),
    completion("top-k-below", "top_k", top_k=-2),
    completion("top-k-overflow", "top_k", TOP_K_OVERFLOW, top_k=10**30),
    completion("min-p-high", "min_p", min_p=2),
    completion("presence-penalty-high", "presence_penalty", presence_penalty=3),
    completion("frequency-penalty-low", "frequency_penalty", frequency_penalty=-3),
    completion("repetition-penalty-zero", "repetition_penalty", repetition_penalty=0),
    completion("stop-number", "stop", UNION_PARAM, stop=5),
    completion("stop-list-of-numbers", "stop", UNION_PARAM, stop=[1, 2]),
    completion("stop-too-many", "stop", stop=["a"] * 17),
    completion("stop-empty-string", "stop", stop=[""]),
    completion("stop-token-ids-string", "stop_token_ids", stop_token_ids="x"),
    completion("stop-token-id-past-vocab", "stop_token_ids", stop_token_ids=[99_999]),
    completion("logit-bias-list", "logit_bias", logit_bias=[1]),
    completion("logit-bias-word-key", "logit_bias", logit_bias={"abc": 1}),
    completion("logit-bias-signed-key", "logit_bias", logit_bias={"+5": 1}),
    completion("logit-bias-superscript-key", "logit_bias", SUPERSCRIPT_KEY, logit_bias={"\u00b2": 1}),
    completion("logit-bias-key-past-vocab", "logit_bias", logit_bias={"99999": 1}),
    completion("logit-bias-value-high", "logit_bias", logit_bias={"5": 500}),
    completion("logit-bias-value-string", "logit_bias.5", logit_bias={"5": "x"}),
    completion("seed-string", "seed", seed="x"),
    completion("seed-over-64-bits", "seed", seed=2**70),
    completion("min-tokens-negative", "min_tokens", min_tokens=-1),
    completion("min-tokens-over-max", "min_tokens", min_tokens=50),
    completion("logprobs-high", "logprobs", logprobs=50),
    completion("best-of", "best_of", best_of=3),
    completion("suffix", "suffix", suffix="x"),
    completion("stream-string", "stream", stream="maybe"),
    completion("stream-options-number", "stream_options", stream_options=5),
    completion("model-number", "model", model=5),
    completion("response-format-type", "response_format.type", response_format={"type": "xml"}),
    completion("response-format-string", "response_format", response_format="json"),
    completion("response-format-no-schema", "response_format.json_schema", response_format={"type": "json_schema"}),
    completion("response-format-bad-schema", "response_format.json_schema.schema",
               response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
    completion("response-format-schema-number", "response_format.json_schema.schema", UNION_PARAM,
               response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}),
    completion("guided-regex-unclosed", "guided_regex", guided_regex="(unclosed"),
    completion("guided-regex-matches-nothing", "guided_regex", PAST_VOCAB, guided_regex="[^\\x00-\\U0010ffff]"),
    completion("guided-choice-empty", "guided_choice", guided_choice=[]),
    completion("guided-grammar-no-root", "guided_grammar", guided_grammar="nonsense ::="),
    completion("guided-json-not-json", "guided_json", guided_json="{not json"),
    completion("guided-json-number", "guided_json", UNION_PARAM, guided_json=5),
    completion("two-constraints", "guided_choice", guided_regex="a", guided_choice=["a"]),
    completion("structured-outputs-empty", "structured_outputs", structured_outputs={}),
    Bad("unknown-model", "/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model", status=404),
    # -- /v1/chat/completions --------------------------------------------------------------
    Bad("no-messages", "/v1/chat/completions", {"max_tokens": 2}, "messages"),
    chat("messages-string", "messages", messages="hi"),
    chat("messages-empty", "messages", messages=[]),
    chat("message-number", "messages.0", messages=[1]),
    chat("message-no-role", "messages.0.role", messages=[{"content": "hi"}]),
    chat("message-unknown-role", "messages.0.role", messages=[{"role": "wizard", "content": "hi"}]),
    chat("message-content-number", "messages.0.content", UNION_PARAM, messages=[{"role": "user", "content": 5}]),
    chat("message-part-without-text", "messages.0.content", UNION_PARAM,
         messages=[{"role": "user", "content": [{"type": "text"}]}]),
    chat("message-image-part", "messages.0.content",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    chat("message-name-number", "messages.0.name", messages=[{"role": "user", "content": "hi", "name": 5}]),
    chat("tool-call-without-name", "messages.0.tool_calls.0.function.name",
         messages=[{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}]),
    chat("tool-call-arguments-number", "messages.0.tool_calls.0.function.arguments", UNION_PARAM,
         messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]),
    chat("chat-over-context", "messages", CHAT_LENGTH_PARAM, messages=[{"role": "user", "content": "hi " * 2000}]),
    chat("max-tokens-zero", "max_tokens", max_tokens=0),
    chat("max-completion-tokens-zero", "max_completion_tokens", max_completion_tokens=0),
    chat("max-completion-tokens-over-context", "max_tokens", max_completion_tokens=5000),
    chat("chat-n-zero", "n", n=0),
    chat("chat-top-p-high", "top_p", top_p=2),
    chat("top-logprobs-without-logprobs", "top_logprobs", top_logprobs=2),
    chat("top-logprobs-high", "top_logprobs", logprobs=True, top_logprobs=21),
    chat("logprobs-string", "logprobs", logprobs="x"),
    chat("tools-string", "tools", tools="x"),
    chat("tool-without-function", "tools.0.function", tools=[{"type": "function"}]),
    chat("tool-name-empty", "tools.0.function.name", tools=[{"type": "function", "function": {"name": ""}}]),
    chat("tool-name-too-long", "tools.0.function.name", tools=[{"type": "function", "function": {"name": "x" * 65}}]),
    chat("tool-type", "tools.0.type", tools=[{"type": "retrieval", "function": {"name": "f"}}]),
    chat("tool-parameters-string", "tools.0.function.parameters",
         tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
    chat("tool-parameters-bad-schema", "tools", tool_choice="required",
         tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]),
    chat("tool-choice-word", "tool_choice", UNION_PARAM, tool_choice="sometimes"),
    chat("tool-choice-without-tools", "tool_choice", tool_choice="required"),
    chat("tool-choice-unknown-function", "tool_choice", tools=[TOOL],
         tool_choice={"type": "function", "function": {"name": "g"}}),
    chat("tool-choice-without-name", "tool_choice", tools=[TOOL], tool_choice={"type": "function"}),
    chat("tool-choice-and-response-format", "response_format", tools=[TOOL], tool_choice="required",
         response_format={"type": "json_object"}),
    chat("template-kwargs-string", "chat_template_kwargs", chat_template_kwargs="x"),
    chat("template-kwargs-reserved", "chat_template_kwargs", chat_template_kwargs={"tokenize": True}),
    chat("template-kwargs-messages", "chat_template_kwargs", TEMPLATE_KWARGS, chat_template_kwargs={"messages": 5}),
    chat("template-kwargs-continue", "chat_template_kwargs", TEMPLATE_KWARGS,
         chat_template_kwargs={"continue_final_message": True}),
    chat("chat-response-format-no-schema", "response_format.json_schema",
         response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
    Bad("chat-unknown-model", "/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, "model", status=404),
    # -- /generate ---------------------------------------------------------------------------
    Bad("no-text-nor-ids", "/generate", {}, "text"),
    generate("text-and-ids", "text", input_ids=[5]),
    generate("text-empty-list", "text", text=[]),
    generate("text-number", "text", UNION_PARAM, text=5),
    Bad("input-ids-empty", "/generate", {"input_ids": []}, "input_ids"),
    Bad("input-ids-empty-in-batch", "/generate", {"input_ids": [[5], []]}, "input_ids"),
    Bad("input-ids-past-vocab", "/generate", {"input_ids": [99_999]}, "input_ids"),
    Bad("input-ids-negative", "/generate", {"input_ids": [[5], [-1]]}, "input_ids"),
    generate("sampling-params-number", "sampling_params", sampling_params=5),
    sampling("max-new-tokens-negative", "max_new_tokens", max_new_tokens=-1),
    sampling("max-new-tokens-over-context", "max_new_tokens", max_new_tokens=5000),
    sampling("min-new-tokens-over-max", "min_new_tokens", min_new_tokens=5),
    sampling("generate-temperature-negative", "temperature", temperature=-1),
    sampling("generate-temperature-huge", "temperature", temperature=1e9),
    sampling("generate-top-p-zero", "top_p", top_p=0),
    sampling("generate-top-k-below", "top_k", top_k=-5),
    sampling("generate-top-k-overflow", "top_k", TOP_K_OVERFLOW, top_k=10**30),
    sampling("generate-n-zero", "n", n=0),
    sampling("generate-presence-penalty", "presence_penalty", presence_penalty=100),
    sampling("generate-repetition-penalty", "repetition_penalty", repetition_penalty=0),
    sampling("generate-stop-number", "stop", UNION_PARAM, stop=5),
    sampling("generate-stop-empty", "stop", stop=""),
    sampling("generate-logit-bias-key", "logit_bias", logit_bias={"x": 1}),
    sampling("generate-logit-bias-past-vocab", "logit_bias", logit_bias={"99999": 1}),
    sampling("generate-stop-token-ids", "stop_token_ids", stop_token_ids=[99_999]),
    sampling("structural-tag", "structural_tag", structural_tag="x"),
    sampling("regex-and-ebnf", "ebnf", regex="a", ebnf="b"),
    sampling("regex-unclosed", "regex", regex="(unclosed"),
    sampling("json-schema-not-json", "json_schema", json_schema="{bad"),
    sampling("generate-seed-over-64-bits", "sampling_seed", sampling_seed=2**70),
    generate("top-logprobs-num-negative", "top_logprobs_num", top_logprobs_num=-1),
    generate("top-logprobs-num-high", "top_logprobs_num", return_logprob=True, top_logprobs_num=100),
    generate("logprob-start-len", "logprob_start_len", logprob_start_len=-2),
    generate("rid-count", "rid", text=["a", "b"], rid="x"),
    generate("rid-number", "rid", UNION_PARAM, rid=5),
    generate("generate-stream-string", "stream", stream="maybe"),
    # -- /tokenize, /detokenize ---------------------------------------------------------------
    Bad("tokenize-nothing", "/tokenize", {}, "prompt"),
    Bad("tokenize-prompt-number", "/tokenize", {"prompt": 5}, "prompt"),
    Bad("tokenize-prompt-list", "/tokenize", {"prompt": ["a"]}, "prompt"),
    Bad("tokenize-both", "/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    Bad("tokenize-messages-empty", "/tokenize", {"messages": []}, "messages", bug=TOKENIZE_EMPTY_MESSAGES),
    Bad("tokenize-unknown-role", "/tokenize", {"messages": [{"role": "x", "content": "a"}]}, "messages.0.role"),
    Bad("tokenize-bad-tool", "/tokenize", {"messages": MESSAGES, "tools": [{"function": {}}]}, "tools.0.function.name"),
    Bad("tokenize-flag-string", "/tokenize", {"prompt": "a", "add_special_tokens": "x"}, "add_special_tokens"),
    Bad("tokenize-unknown-model", "/tokenize", {"prompt": "a", "model": "other"}, "model", status=404),
    Bad("detokenize-nothing", "/detokenize", {}, "tokens"),
    Bad("detokenize-string", "/detokenize", {"tokens": "abc"}, "tokens"),
    Bad("detokenize-past-vocab", "/detokenize", {"tokens": [5, 99_999]}, "tokens"),
    Bad("detokenize-negative", "/detokenize", {"tokens": [1, -5]}, "tokens"),
    Bad("detokenize-fraction", "/detokenize", {"tokens": [1.5]}, "tokens.0"),
    Bad("detokenize-nested", "/detokenize", {"tokens": [[1]]}, "tokens.0"),
    Bad("detokenize-unknown-model", "/detokenize", {"tokens": [1], "model": "other"}, "model", status=404),
    # -- routes and methods -------------------------------------------------------------------
    Bad("retrieve-unknown-model", "/v1/models/other", method="GET", param="model", status=404),
    Bad("retrieve-nested-unknown-model", "/v1/models/org/other", method="GET", param="model", status=404),
    Bad("unknown-route", "/v1/nothing-here", method="GET", status=404, type=NOT_FOUND),
    Bad("get-completions", "/v1/completions", method="GET", status=405),
    Bad("post-models", "/v1/models", {}, status=405),
    Bad("delete-generate", "/generate", method="DELETE", status=405),
    Bad("get-tokenize", "/tokenize", method="GET", status=405),
]

# Valid requests at the edge of the ranges (or, for /generate's input_ids,
# holding token 0): each must be served, never fail a step.
EDGE_CASES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("temperature-denormal", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1e-45}, PAST_VOCAB),
    ("top-p-tiny", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": 1e-300}, PAST_VOCAB),
    ("repetition-penalty-tiny", "/v1/completions",
     {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-300}, PAST_VOCAB),
    ("min-p-one", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_p": 1.0}, None),
    ("all-tokens-biased-away", "/v1/completions",
     {"prompt": "hi", "max_tokens": 2, "logit_bias": {str(i): -100 for i in range(300)}}, None),
    ("token-zero-in-input-ids", "/generate", {"input_ids": [5, 0, 6], "sampling_params": {"max_new_tokens": 1}},
     None),
    ("seed-max-uint64", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1}, None),
    ("max-tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1}, None),
]


# -- the server and the checks ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_checkpoints: dict[str, Path]):
    """A tiny Llama with a chat template (chat rows need one); a small KV
    pool keeps the integrity check after every row cheap."""
    started = start_server(
        tiny_checkpoints["llama"], "--served-model-name", "tiny-bad", "--page-size", "4", "--num-pages", "2048",
        "--debug-integrity", "--max-request-bytes", str(MAX_REQUEST_BYTES),
    )
    yield started
    started.stop()


def assert_healthy_and_intact(server: RunningServer) -> dict[str, Any]:
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200, server.log()[-3000:]
    info = server.wait_idle(timeout=30.0)
    assert info["kv_integrity"] == "ok", info["kv_integrity"]
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"], info
    return info


@pytest.fixture(autouse=True)
def healthy_after_each_request(server: RunningServer):
    yield
    assert_healthy_and_intact(server)


def send(server: RunningServer, row: Bad) -> httpx.Response:
    headers = {"content-type": row.content_type} if row.content_type else {}
    if row.raw is not None:
        content = row.raw
    elif row.body is not None:
        content = json.dumps(row.body).encode()
    else:
        content = None
    return httpx.request(row.method, f"{server.url}{row.path}", content=content, headers=headers, timeout=60)


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    """The body is {"error": {message, type, param, code}}, nothing else."""
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


def _params(rows: list[Bad]) -> list[Any]:
    return [
        pytest.param(row, id=row.name, marks=[pytest.mark.xfail(reason=row.bug, strict=False)] if row.bug else [])
        for row in rows
    ]


def test_the_table_is_wide() -> None:
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names)), "row names must be unique"
    assert len(ROWS) >= 40
    for endpoint in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize", "/v1/models"):
        assert any(row.path.startswith(endpoint) for row in ROWS), endpoint


@pytest.mark.parametrize("row", _params(ROWS))
def test_bad_request(server: RunningServer, row: Bad) -> None:
    before = server.info()["stats"]
    started = time.monotonic()
    response = send(server, row)
    elapsed = time.monotonic() - started
    assert response.status_code == row.status, response.text[:500]
    error = assert_openai_error(response)
    assert (error["type"], error["param"]) == (row.type, row.param), error
    if row.max_seconds is not None:
        assert elapsed < row.max_seconds, f"took {elapsed:.2f}s"
    after = assert_healthy_and_intact(server)["stats"]
    assert after == before, "a refused request reached the scheduler"


@pytest.mark.parametrize(
    ("path", "body"),
    [pytest.param(path, body, id=name, marks=[pytest.mark.xfail(reason=bug, strict=False)] if bug else [])
     for name, path, body, bug in EDGE_CASES],
)
def test_edge_values_are_served(server: RunningServer, path: str, body: dict[str, Any]) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text[:500]


def test_a_bad_neighbour_does_not_fail_other_requests(server: RunningServer) -> None:
    """A request whose sampling goes wrong must fail alone, not its whole batch."""
    import threading

    victim: dict[str, httpx.Response] = {}

    def long_request() -> None:
        body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True}
        victim["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while server.info()["running"] == 0 and time.monotonic() < deadline:  # share a step with it
        time.sleep(0.01)
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_p": 1e-300}, timeout=60)
    thread.join()
    assert victim["response"].status_code == 200, victim["response"].text[:200]
