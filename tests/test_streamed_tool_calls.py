"""Streamed tool calls through the real server, read by the official openai
client's stream helper (client.chat.completions.stream, which accumulates
chunks with ChatCompletionStreamState): for each --tool-call-parser format
the model's output (forced to a known text by a `choice` constraint) comes
back as one call whose id, type and name arrive first and whose arguments
arrive in several deltas, and the accumulated message holds the parsed call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

ARGUMENTS = {"city": "Paris", "days": 3}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather", "strict": True,
        "parameters": {
            "type": "object", "additionalProperties": False, "required": ["city", "days"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}]
OUTPUTS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "pythonic": '[get_weather(city="Paris", days=3)]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
}


# Each format needs a server of its own (~15 s to start on 2 cores): two in
# the default run, the rest with the slow tests (their parsers' pieces are
# checked without a server in test_tool_parsers.py).
SLOW = ("llama3_json", "mistral", "pythonic")


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in sorted(OUTPUTS)
])
def parser_server(request: pytest.FixtureRequest, tiny_checkpoints: dict[str, Path]):
    from server_harness import start_server

    server = start_server(
        tiny_checkpoints["llama"], "--served-model-name", "tiny-chat", "--tool-call-parser", request.param,
    )
    yield request.param, server
    server.stop()


def test_streamed_call_round_trips_through_the_openai_stream_helper(parser_server: tuple[str, Any]) -> None:
    name, server = parser_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    request: dict[str, Any] = dict(
        model="tiny-chat", messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        tools=TOOLS, temperature=0, max_tokens=200,
        extra_body={"structured_outputs": {"choice": [OUTPUTS[name]]}},
    )
    tool_deltas = []
    argument_events = 0
    with client.chat.completions.stream(**request) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                tool_deltas += event.chunk.choices[0].delta.tool_calls
            if event.type == "tool_calls.function.arguments.delta":
                argument_events += 1
        final = stream.get_final_completion()
    first, *later = tool_deltas
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert later and all(d.id is None and d.function.name is None for d in later)
    assert argument_events >= 2, "the arguments arrive in pieces"
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id == first.id
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert call.function.parsed_arguments == ARGUMENTS  # the helper's own parse of the accumulated text
    # The whole (non-streamed) response reads the same call.
    whole = client.chat.completions.create(**request)
    (whole_call,) = whole.choices[0].message.tool_calls
    assert (whole_call.function.name, json.loads(whole_call.function.arguments)) == ("get_weather", ARGUMENTS)


def test_streamed_call_round_trips_through_langchain(parser_server: tuple[str, Any]) -> None:
    """langchain-openai's ChatOpenAI, streaming with bound tools: the chunks it
    adds together (AIMessageChunk's tool_call_chunks, merged by index) make
    one call with the parsed arguments, as its non-streamed invoke does."""
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai not installed")
    name, server = parser_server
    model = langchain_openai.ChatOpenAI(
        model="tiny-chat", base_url=f"{server.url}/v1", api_key="none", temperature=0, max_tokens=200,
        extra_body={"structured_outputs": {"choice": [OUTPUTS[name]]}},
    ).bind_tools(TOOLS)
    question = "Weather in Paris for 3 days?"
    chunks = list(model.stream(question))
    assert sum(1 for chunk in chunks if chunk.tool_call_chunks) >= 3, "the name, then the arguments in pieces"
    message = chunks[0]
    for chunk in chunks[1:]:
        message = message + chunk
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"] == ARGUMENTS and call["id"]
    (whole_call,) = model.invoke(question).tool_calls
    assert (whole_call["name"], whole_call["args"]) == ("get_weather", ARGUMENTS)
