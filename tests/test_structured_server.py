"""Structured output, tool calls and reasoning over HTTP with the official
openai client, on a random-weight model with the real Qwen3 vocabulary and
chat template: `chat.completions.parse`, streamed forced tool calls, a
multi-turn conversation with tool results, the vLLM and SGLang spellings,
and 400s that name the field. Response bodies and chunks are checked against
OpenAI's published spec."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import SHARED
from real_vocab_models import real_vocab_checkpoint
from test_openapi_spec import assert_matches

MODEL = "tiny-qwen3"
QUOTE = 1  # '"' in Qwen3's vocabulary: made likely, so that random-weight strings close
BIAS = {str(QUOTE): 9.0}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Zürich"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 5}}, "required": ["tz"]}}},
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return real_vocab_checkpoint("qwen3", SHARED, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(qwen3_path):
    from server_harness import start_server

    # Thinking off unless a request turns it on: a thinking model's grammar
    # starts after its thought, which a random-weight model never ends.
    server = start_server(
        qwen3_path, "--served-model-name", MODEL, "--reasoning-parser", "qwen3", "--device", "cpu", "--num-pages", "2000",
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)


class Owner(BaseModel):
    nick: str = Field(max_length=6)
    vip: bool


class Pet(BaseModel):
    kind: Literal["cat", "dog", "axolotl"]
    age: int = Field(ge=0, le=30)
    owner: Owner
    tags: list[Literal["calm", "loud"]] = Field(max_length=3)


def test_parse_returns_a_validated_object(client) -> None:
    parsed = []
    for seed in range(6):
        completion = client.chat.completions.parse(
            model=MODEL, messages=ASK, response_format=Pet, max_tokens=120, seed=seed, temperature=1.0,
            logit_bias=BIAS,
        )
        choice = completion.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(choice.message.parsed, Pet)
            parsed.append(choice.message.parsed)
    assert len(parsed) >= 4


def assemble(chunks: list[dict]) -> tuple[dict[int, dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        assert_matches(chunk, "CreateChatCompletionStreamResponse")
        for choice in chunk["choices"]:
            finish = choice["finish_reason"] or finish
            for piece in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = piece.get("id") or call["id"]
                function = piece.get("function", {})
                call["name"] = function.get("name") or call["name"]
                call["arguments"] += function.get("arguments", "")
    return calls, finish


def stream_chunks(server, **body) -> list[dict]:
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL, "stream": True, **body}, timeout=120
    )
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_stream_valid_arguments(server, client, tool_choice) -> None:
    finished = 0
    for seed in range(4):
        # Random weights may go on calling (a parallel call after each): let some run out of tokens.
        body = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=160, seed=seed, logit_bias=BIAS)
        calls, finish = assemble(stream_chunks(server, **body))
        if finish == "length":
            continue
        finished += 1
        assert finish == "tool_calls" and calls
        for call in calls.values():
            assert call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
        if isinstance(tool_choice, dict):
            assert [c["name"] for c in calls.values()] == ["get_weather"]
        # The openai client assembles the same calls from its own parse of the stream.
        with client.chat.completions.stream(model=MODEL, **body) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
            (c["name"], json.loads(c["arguments"])) for c in calls.values()
        ]
        whole = chat(server, **body).json()
        assert_matches(whole, "CreateChatCompletionResponse")
        message = whole["choices"][0]["message"]
        assert message["content"] is None and whole["choices"][0]["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
            (c["name"], json.loads(c["arguments"])) for c in calls.values()
        ]
    assert finished >= 2


def test_parallel_tool_calls_false_makes_one_call(server) -> None:
    for seed in range(3):
        body = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=160,
                    seed=seed, logit_bias=BIAS)
        calls, finish = assemble(stream_chunks(server, **body))
        assert finish == "tool_calls" and len(calls) == 1


def test_a_conversation_with_tool_results_round_trips(server, client, qwen3_path) -> None:
    from transformers import AutoTokenizer

    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 24°C"}'},
        {"role": "user", "content": "And in Tokyo?"},
    ]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120, seed=1, logit_bias=BIAS
    )
    assert completion.choices[0].message.tool_calls
    # The prompt the server computed is the template's rendering of the whole conversation.
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_path))
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": "", "tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages],
        tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False,  # the server default
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in rendered
    assert "<tool_response>\n{\"forecast\": \"sunny, 24°C\"}\n</tool_response>" in rendered
    assert completion.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_auto_tool_calls_and_reasoning_are_parsed_from_the_text(server) -> None:
    """A regex makes the random model write a think block and a call in
    Qwen's format; the parsers turn them into reasoning_content and tool_calls."""
    regex = r'<think>\n[a-z]{1,8}( [a-z]{1,8}){0,3}\n</think>\n\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>'
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, seed=3, structured_outputs={"regex": regex})  # thinking off: the regex writes the thought
    whole = chat(server, **body).json()
    assert_matches(whole, "CreateChatCompletionResponse")
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", whole
    assert choice["message"]["reasoning_content"] and "<think>" not in choice["message"]["reasoning_content"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["tz"] in ("UTC", "CET")
    calls, finish = assemble(stream_chunks(server, **body))
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_time"]


def test_enable_thinking_reaches_the_template(server) -> None:
    tokens = [
        chat(server, messages=ASK, max_tokens=1, chat_template_kwargs=kwargs).json()["usage"]["prompt_tokens"]
        for kwargs in ({"enable_thinking": True}, {})  # the server's default: false
    ]
    assert tokens[1] == tokens[0] + 4  # "<think>", "\n\n", "</think>", "\n\n"


def test_a_thinking_model_thinks_before_its_grammar(server, qwen3_path) -> None:
    """With thinking on, the grammar starts after </think>: a bias that makes
    </think> the likeliest token puts it first (no JSON grammar allows it),
    and the answer after it is the schema's JSON. With thinking off the same
    request is JSON from its first token."""
    from transformers import AutoTokenizer

    end_think = AutoTokenizer.from_pretrained(str(qwen3_path)).convert_tokens_to_ids("</think>")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    body = dict(
        messages=ASK, max_tokens=40, seed=1, logit_bias={str(end_think): 100, **BIAS},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    thought = chat(server, **body, chat_template_kwargs={"enable_thinking": True}).json()
    content = thought["choices"][0]["message"]["content"]
    assert content.startswith("</think>"), thought  # free while thinking
    assert isinstance(json.loads(content.removeprefix("</think>"))["ok"], bool)
    direct = chat(server, **body).json()["choices"][0]["message"]["content"]
    assert isinstance(json.loads(direct)["ok"], bool)  # grammar from the first token: no </think>


def test_vllm_and_sglang_spellings(server) -> None:
    choices = ["red", "green", "blue ✓"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        body = {"model": MODEL, "prompt": "Colour:", "max_tokens": 10, "n": 3, "seed": 5, **extra}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert_matches(response, "CreateCompletionResponse")
        assert all(c["text"] in choices and c["finish_reason"] == "stop" for c in response["choices"])
    regex = r"\d{3}-[A-Z]{2}"
    response = chat(server, messages=ASK, max_tokens=12, guided_regex=regex, stream=False).json()
    assert re.fullmatch(regex, response["choices"][0]["message"]["content"])
    response = chat(server, messages=ASK, max_tokens=12, response_format={"type": "json_object"}, seed=2,
                    logit_bias=BIAS).json()
    assert response["choices"][0]["message"]["content"].startswith("{")
    for sampling in ({"regex": regex}, {"ebnf": 'root ::= "ab" [0-9]+ "."'},
                     {"json_schema": json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                 "required": ["ok"]})}):
        out = httpx.post(f"{server.url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 20, **sampling}},
                         timeout=60).json()
        text = out["text"]
        if "regex" in sampling:
            assert re.fullmatch(regex, text)
        elif "ebnf" in sampling:
            assert text.startswith("ab") and (out["meta_info"]["finish_reason"]["type"] == "length" or text.endswith("."))
        else:
            assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "response_format.json_schema.schema"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, body, param) -> None:
    response = chat(server, messages=ASK, max_tokens=4, **body)
    assert response.status_code == 400, response.text
    assert_matches(response.json(), "ErrorResponse")
    assert response.json()["error"]["param"] == param


def test_streamed_json_schema_with_n_and_logprobs(server) -> None:
    schema = Pet.model_json_schema()
    body = dict(messages=ASK, n=2, seed=4, logprobs=True, top_logprobs=2, max_tokens=120, logit_bias=BIAS,
                response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}})
    texts, finish, logprob_count = {0: "", 1: ""}, {}, {0: 0, 1: 0}
    for chunk in stream_chunks(server, **body):
        assert_matches(chunk, "CreateChatCompletionStreamResponse")
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
            if choice["logprobs"]:
                logprob_count[choice["index"]] += len(choice["logprobs"]["content"])
    assert texts[0] != texts[1]
    for index, text in texts.items():
        assert logprob_count[index] > 0
        if finish[index] == "stop":
            Pet.model_validate_json(text)
        else:
            assert finish[index] == "length" and logprob_count[index] == 120


def test_bounded_strings_stay_valid_json_under_a_control_character_bias(server, qwen3_path) -> None:
    """A bias toward every token holding a control character (TAB, NUL, ...)
    and toward the backslash: a maxLength string may then only take such a
    character escaped, so every output is strict JSON (json.loads) that
    validates, and some carry the escaped character the model was pushed to."""
    from jsonschema import Draft202012Validator
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_path))
    control = [i for i in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([i]))]
    backslash = tokenizer.convert_tokens_to_ids("\\")
    assert control and isinstance(backslash, int)
    bias = {**{str(i): 8.0 for i in control}, str(backslash): 6.0, **BIAS}
    schema = {
        "type": "object", "additionalProperties": False, "required": ["name", "code"],
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                       "code": {"type": "string", "maxLength": 4}},
    }
    escaped = 0
    for seed in range(6):
        response = chat(
            server, messages=ASK, max_tokens=80, seed=seed, temperature=1.0, logit_bias=bias,
            response_format={"type": "json_schema", "json_schema": {"name": "tag", "schema": schema}},
        ).json()
        choice = response["choices"][0]
        if choice["finish_reason"] != "stop":
            continue
        value = json.loads(choice["message"]["content"])  # strict: a raw control character raises
        assert not list(Draft202012Validator(schema).iter_errors(value)), value
        escaped += "\\" in choice["message"]["content"]
    assert escaped, "the bias should have led some output to an escape"
    # Unconstrained, the same bias does write raw control characters: the grammar is what keeps them out.
    free = chat(server, messages=ASK, max_tokens=20, seed=0, logit_bias=bias).json()
    assert any(ord(c) < 0x20 and c not in "\n" for c in free["choices"][0]["message"]["content"])


def test_tokenize_honours_chat_template_kwargs(server) -> None:
    """/v1/tokenize (and vLLM's /tokenize) count a chat as the chat request
    renders it, chat_template_kwargs included: the counts agree."""
    for kwargs in ({"enable_thinking": True}, {}):
        prompt_tokens = chat(server, messages=ASK, max_tokens=1, chat_template_kwargs=kwargs).json()["usage"]["prompt_tokens"]
        for path in ("/v1/tokenize", "/tokenize"):
            response = httpx.post(f"{server.url}{path}", json={"model": MODEL, "messages": ASK, "chat_template_kwargs": kwargs})
            assert response.status_code == 200, response.text
            assert response.json()["count"] == prompt_tokens, (path, kwargs)
    tokens = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    text = httpx.post(f"{server.url}/v1/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "Hello world"
