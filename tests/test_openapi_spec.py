"""Every body the OpenAI endpoints send, checked against OpenAI's published
spec (its response schemas, trimmed, in tests/fixtures/openai-openapi/), and the request-side details the
spec asks for: null fields, models.retrieve, max_tokens 0, the default of 16
tokens, text offsets, text-only messages."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).parent / "fixtures" / "openai-openapi" / "openapi.json"
SPEC_URI = "urn:openai-openapi"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "You are a robot."}, {"role": "user", "content": "Tell me about the sea."}]


# -- the spec as a JSON Schema registry ---------------------------------------------


def _nullable_as_union(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true`, which JSON Schema ignores, as "or null"."""
    if isinstance(node, list):
        return [_nullable_as_union(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable_as_union(value) for key, value in node.items()}
    if node.get("nullable") is True:
        del node["nullable"]
        return {"anyOf": [node, {"type": "null"}]}
    return node


@cache
def validator(schema: str) -> Draft202012Validator:
    document = _nullable_as_union(json.loads(SPEC.read_text()))
    registry = Registry().with_resource(SPEC_URI, DRAFT202012.create_resource(document))
    return Draft202012Validator({"$ref": f"{SPEC_URI}#/components/schemas/{schema}"}, registry=registry)


def assert_matches(body: Any, schema: str) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(schema).iter_errors(body)]
    assert not errors, f"{schema}: {errors[:5]}\n{json.dumps(body)[:2000]}"


def spec_exceptions_for_completion(body: dict, echoed: set[int], mid_stream: bool) -> dict:
    """A copy with the two places where OpenAI's own API departs from its
    spec made to fit, and only those: the first echoed token has no logprob
    (null), and a stream's chunks before a choice's last have a null
    finish_reason."""
    body = copy.deepcopy(body)
    for choice in body["choices"]:
        if mid_stream and choice["finish_reason"] is None:
            choice["finish_reason"] = "length"
        logprobs = choice["logprobs"]
        if choice["index"] in echoed and logprobs is not None:
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            logprobs["token_logprobs"][0], logprobs["top_logprobs"][0] = 0.0, {}
    return body


def sse_events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# -- fixtures ------------------------------------------------------------------------


# The stories server's KV pool is checked after every test (conftest.stories_kv_intact);
# the openai client and model id are conftest's stories_client and stories_model.
pytestmark = pytest.mark.usefixtures("stories_kv_intact")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


# -- the validator itself --------------------------------------------------------------


def test_the_validator_rejects_what_the_spec_forbids() -> None:
    good = {
        "id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi", "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}],
    }
    assert_matches(good, "CreateChatCompletionResponse")
    no_refusal = copy.deepcopy(good)
    del no_refusal["choices"][0]["message"]["refusal"]
    bad_reason = copy.deepcopy(good)
    bad_reason["choices"][0]["finish_reason"] = "abort"
    for bad in (no_refusal, bad_reason):
        assert list(validator("CreateChatCompletionResponse").iter_errors(bad))
    # nullable: true became "or null": a null usage is fine on a chunk, a string is not.
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": None}
    assert_matches(chunk, "CreateChatCompletionStreamResponse")
    assert list(validator("CreateChatCompletionStreamResponse").iter_errors({**chunk, "usage": "none"}))


# -- completions -------------------------------------------------------------------------


def test_completion_bodies_match_the_spec(stories_server) -> None:
    plain = post(stories_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}).json()
    assert_matches(plain, "CreateCompletionResponse")
    batch = post(
        stories_server, "/v1/completions",
        {"prompt": [PROMPT, "The dog"], "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": 2, "logprobs": 2},
    ).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert_matches(batch, "CreateCompletionResponse")
    echoed = post(
        stories_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "n": 2, "echo": True, "logprobs": 2}
    ).json()
    assert_matches(spec_exceptions_for_completion(echoed, {0, 1}, mid_stream=False), "CreateCompletionResponse")


def test_streamed_completion_chunks_match_the_spec(stories_server) -> None:
    body = {
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 5, "n": 2, "logprobs": 2, "echo": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    chunks = sse_events(post(stories_server, "/v1/completions", body))
    *text_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 16
    assert_matches(usage_chunk, "CreateCompletionResponse")
    seen: set[int] = set()
    for i, chunk in enumerate(text_chunks):
        first = {c["index"] for c in chunk["choices"]} - seen
        seen |= first
        later = [c for later_chunk in text_chunks[i + 1 :] for c in later_chunk["choices"]]
        for choice in chunk["choices"]:  # a null finish_reason only where more of that choice follows
            assert (choice["finish_reason"] is None) == any(c["index"] == choice["index"] for c in later)
        assert_matches(spec_exceptions_for_completion(chunk, first, mid_stream=True), "CreateCompletionResponse")
    assert seen == {0, 1}


# -- chat --------------------------------------------------------------------------------


def test_chat_bodies_and_chunks_match_the_spec(chat_server) -> None:
    body = {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 8, "temperature": 0.8, "seed": 1, "n": 2}
    whole = post(chat_server, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2}).json()
    assert_matches(whole, "CreateChatCompletionResponse")
    for choice in whole["choices"]:
        assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
    assert sum(len(c["logprobs"]["content"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"]
    assert_matches(post(chat_server, "/v1/chat/completions", body).json(), "CreateChatCompletionResponse")
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    chunks = sse_events(post(chat_server, "/v1/chat/completions", stream))
    for chunk in chunks:
        assert_matches(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with_logprobs = [c for chunk in chunks for c in chunk["choices"] if c.get("logprobs")]
    assert with_logprobs and all(c["logprobs"]["refusal"] is None for c in with_logprobs)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert sorted(c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]) == [0, 1]


def test_image_content_gets_a_clear_400(chat_server) -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    for messages, param in [
        ([{"role": "user", "content": [image]}], "messages.0.content"),
        ([MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}], "messages.1.content"),
    ]:
        response = post(chat_server, "/v1/chat/completions", {"model": "tiny-chat", "messages": messages})
        assert response.status_code == 400
        assert_matches(response.json(), "ErrorResponse")
        error = response.json()["error"]
        assert error["param"] == param
        assert "text only" in error["message"] and "image_url" in error["message"]


# -- models and errors -------------------------------------------------------------------


def test_models_list_and_retrieve(stories_server, stories_client, stories_model) -> None:
    listed = httpx.get(f"{stories_server.v1}/models").json()
    assert_matches(listed, "ListModelsResponse")
    retrieved = stories_client.models.retrieve(stories_model)  # ids with slashes: a path converter, %2F decoded
    assert retrieved.id == stories_model and retrieved.object == "model"
    raw = httpx.get(f"{stories_server.v1}/models/{stories_model}")
    assert raw.status_code == 200 and raw.json() == listed["data"][0]
    assert_matches(raw.json(), "Model")
    for other in ("Qwen/Qwen3-0.6B", "gpt-4"):
        with pytest.raises(openai.NotFoundError) as info:
            stories_client.models.retrieve(other)
        assert info.value.code == "model_not_found"
        response = httpx.get(f"{stories_server.v1}/models/{other}")
        assert response.status_code == 404
        assert_matches(response.json(), "ErrorResponse")


def test_error_bodies_match_the_spec(stories_server, chat_server, templateless_server) -> None:
    responses = [
        post(stories_server, "/v1/completions", {"prompt": PROMPT, "temperature": -1}),
        post(stories_server, "/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}),
        post(stories_server, "/v1/completions", {"prompt": "hi " * 600}),
        post(templateless_server, "/v1/chat/completions", {"messages": MESSAGES}),  # no chat template
        post(chat_server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
        httpx.post(f"{stories_server.v1}/completions", content=b"{not json"),
        httpx.get(f"{stories_server.v1}/nothing-here"),
        httpx.get(f"{stories_server.v1}/completions"),
    ]
    for response in responses:
        assert 400 <= response.status_code < 500
        assert_matches(response.json(), "ErrorResponse")


# -- request fields ----------------------------------------------------------------------


def test_null_means_the_default(stories_server, chat_server) -> None:
    nulls = {
        "n": None, "stream": None, "stream_options": None, "presence_penalty": None, "frequency_penalty": None,
        "temperature": None, "top_p": None, "seed": None, "stop": None, "logit_bias": None, "user": None,
    }
    completion = post(
        stories_server, "/v1/completions",
        {**nulls, "prompt": PROMPT, "echo": None, "logprobs": None, "best_of": None, "suffix": None, "max_tokens": 5},
    )
    assert completion.status_code == 200, completion.text
    body = completion.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    assert not body["choices"][0]["text"].startswith(PROMPT)  # echo: null is echo: false
    assert_matches(body, "CreateCompletionResponse")
    chat = post(
        chat_server, "/v1/chat/completions",
        {**nulls, "messages": MESSAGES, "logprobs": None, "top_logprobs": None, "max_tokens": None,
         "max_completion_tokens": 4, "tools": None, "response_format": None, "metadata": None, "store": None},
    )
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    assert_matches(chat.json(), "CreateChatCompletionResponse")


def test_max_tokens_null_or_absent_means_16(stories_server) -> None:
    for extra in ({"max_tokens": None}, {}):
        body = post(stories_server, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True, **extra}).json()
        assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_max_tokens_0_scores_the_prompt(stories_server, stories_client, stories_model) -> None:
    scored = stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    reference = stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2, temperature=0)
    choice, ref = scored.choices[0], reference.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == reference.usage.prompt_tokens
    n = scored.usage.prompt_tokens
    assert choice.logprobs.tokens == ref.logprobs.tokens[:n]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(ref.logprobs.token_logprobs[1:n], abs=1e-5)
    assert choice.logprobs.text_offset == ref.logprobs.text_offset[:n]
    streamed = sse_events(post(stories_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed) == PROMPT
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


def test_text_offsets_index_the_returned_text(stories_server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "echo": True, "logprobs": 0}
    choice = post(stories_server, "/v1/completions", body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    # <s> is not in the text: it takes no room, and "Once" (" Once" as a token) starts the text.
    assert lp["tokens"][:5] == ["<s>", " Once", " upon", " a", " time"]
    assert lp["text_offset"][:5] == [0, 0, 4, 9, 11]
    assert lp["text_offset"][5] == len(PROMPT)
    for token, offset in list(zip(lp["tokens"], lp["text_offset"]))[2:]:
        assert text[offset:].startswith(token), (token, offset, text)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(text)
    # A stream's offsets continue across its chunks: they index the joined text.
    chunks = sse_events(post(stories_server, "/v1/completions", {**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]
    # Without echo, offsets count from the start of the completion.
    plain = post(stories_server, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    assert plain["logprobs"]["text_offset"][0] == 0
    assert plain["logprobs"]["text_offset"] == [o - len(PROMPT) for o in lp["text_offset"][5:]]
