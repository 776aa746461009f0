"""/v1/responses through the official openai client: client.responses.create
(text and message-list input, instructions, text.format json_schema,
function tools, max_output_tokens, usage) and client.responses.stream (the
typed events, accumulated by the client into the final response)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

TOOLS = [{
    "type": "function", "name": "get_weather", "description": "Weather for a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}},
}]


@pytest.fixture(scope="module")
def client(stories_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stories_server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tool_client(chat_server: Any) -> openai.OpenAI:
    """A tiny Llama with a longer context: tool listings take room."""
    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="none", max_retries=0)


def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_text_input_instructions_and_usage(client: openai.OpenAI, stories_server: Any) -> None:
    response = client.responses.create(
        model=model(client), input="Tell me a story.", instructions="You tell stories.", max_output_tokens=12,
        temperature=0,
    )
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output_text
    assert response.usage.output_tokens <= 12 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )
    # The same conversation as chat messages gives the same prompt and text.
    chat = client.chat.completions.create(
        model=model(client), messages=[{"role": "system", "content": "You tell stories."},
                                       {"role": "user", "content": "Tell me a story."}],
        max_tokens=12, temperature=0,
    )
    assert chat.usage.prompt_tokens == response.usage.input_tokens
    assert chat.choices[0].message.content == response.output_text
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_message_list_input(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=model(client), max_output_tokens=5, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
               {"role": "user", "content": "Tell me a story."}],
    )
    assert response.usage.input_tokens > 10 and response.output_text


class Story(BaseModel):
    title: str
    happy: bool


def test_json_schema_format(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model=model(client), input="A story as JSON.", text_format=Story, max_output_tokens=60, temperature=0,
    )
    if response.status == "completed":
        assert isinstance(response.output_parsed, Story)
    else:
        assert response.output_text.startswith('{"title": "')


def test_function_tools(tool_client: openai.OpenAI) -> None:
    client = tool_client
    response = client.responses.create(
        model=model(client), input="Weather in Paris?", tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=30, temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Tokyo")
    # The call and its output go back as input items.
    follow = client.responses.create(
        model=model(client), tools=TOOLS, tool_choice="none", max_output_tokens=5, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'}],
    )
    assert follow.usage.input_tokens > response.usage.input_tokens


ANSWER = {"type": "json_schema", "name": "answer", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["answer"],
    "properties": {"answer": {"enum": ["once upon a time", "the end"]}}}}


def test_streaming_events_accumulate_to_the_final_response(client: openai.OpenAI) -> None:
    """A schema the output completes (so the stream ends with response.completed,
    which the client's helper waits for)."""
    kinds = []
    text = ""
    request = dict(model=model(client), input="Tell me a story.", max_output_tokens=40, temperature=0,
                   text={"format": ANSWER})
    with client.responses.stream(**request) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.content_part.done", "response.output_item.done"} <= set(kinds)
    assert kinds.count("response.output_text.delta") >= 2
    assert final.output_text == text and json.loads(text)["answer"] in ("once upon a time", "the end")
    assert final.status == "completed" and final.usage.output_tokens >= 2
    whole = client.responses.create(**request)
    assert whole.output_text == text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(stories_server: Any) -> None:
    response = httpx.post(f"{stories_server.url}/v1/responses", timeout=60, json={
        "input": "Tell me a story.", "max_output_tokens": 3, "stream": True, "temperature": 0})
    events = [json.loads(e.removeprefix("data: ")) for e in response.text.split("\n\n")
              if e.startswith("data: {")]
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 3
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_streamed_function_call(tool_client: openai.OpenAI) -> None:
    client = tool_client
    with client.responses.stream(
        model=model(client), input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60, temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert len(deltas) >= 2 and "".join(deltas) == call.arguments
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")


def test_refused_fields_name_themselves(stories_server: Any) -> None:
    for body, param in (
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ):
        response = httpx.post(f"{stories_server.url}/v1/responses", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


ITEM_SCHEMAS = {"message": "OutputMessage", "function_call": "FunctionToolCall", "reasoning": "ReasoningItem"}


def assert_response_matches_the_spec(response: dict[str, Any]) -> None:
    """The output items and the usage, against OpenAI's schemas of them."""
    from test_openapi_spec import assert_matches

    for item in response["output"]:
        assert_matches(item, ITEM_SCHEMAS[item["type"]])
    if response["usage"] is not None:
        # The one departure, made to fit here and only here: the spec now
        # requires input_tokens_details.cache_write_tokens, which the server
        # has never sent (adding it would change the wire).
        usage = copy.deepcopy(response["usage"])
        assert "cache_write_tokens" not in usage["input_tokens_details"]
        usage["input_tokens_details"]["cache_write_tokens"] = 0
        assert_matches(usage, "ResponseUsage")


def test_output_items_match_the_spec(stories_server: Any, chat_server: Any) -> None:
    """Whole and streamed, a message and a function call; the reasoning item
    as the server builds it (these servers have no reasoning parser)."""
    from test_openapi_spec import assert_matches

    from aioserve.server.output.responses_api_bodies import ReasoningItem, ReasoningTextContent

    forced = {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}
    for server, extra in ((stories_server, {}), (chat_server, forced)):
        body = {"input": "Weather in Paris?", "max_output_tokens": 30, "temperature": 0, **extra}
        whole = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
        assert whole.status_code == 200, whole.text
        assert_response_matches_the_spec(whole.json())
        streamed = httpx.post(f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=60)
        events = [json.loads(e.removeprefix("data: ")) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
        for event in events:
            if "item" in event:
                assert_matches(event["item"], ITEM_SCHEMAS[event["item"]["type"]])
            if "part" in event:
                assert_matches(event["part"], "OutputTextContent")
        assert_response_matches_the_spec(events[-1]["response"])
        assert {item["type"] for item in events[-1]["response"]["output"]} == (
            {"function_call"} if extra else {"message"}
        )
    reasoning = ReasoningItem(id="rs_1", content=[ReasoningTextContent(text="Hmm.")], status="completed")
    assert_matches(json.loads(reasoning.model_dump_json()), "ReasoningItem")
