"""Tool-call parsers on hand-written model outputs, whole and streamed in
small random pieces (which must give the same message), the forced-call
readers, the template fallback for templates that ignore tools, and the CLI
choices."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from aioserve.config import ServerArgs
from aioserve.server.output import tool_parsers
from aioserve.server.output.content import ContentDelta, ContentProcessor
from aioserve.server.output.reasoning import PARSERS as REASONING_PARSERS
from aioserve.server.output.tool_parsers.forced import NamedCall, RequiredCalls
from aioserve.server.output.tools import ToolPlan, template_messages
from real_vocab_models import build_fixture_tokenizer


def run(processor: ContentProcessor, text: str, pieces: int, seed: int = 0, reason: str = "stop") -> tuple[ContentDelta, str]:
    """Feed `text` in `pieces` random pieces; the merged message and the finish reason."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces - 1, len(text) - 1))) if len(text) > 1 else []
    message = ContentDelta()
    for start, end in zip([0] + cuts, cuts + [len(text)]):
        message.merge(processor.feed(text[start:end]))
    rest, final = processor.finish(reason)
    message.merge(rest)
    return message, final


def calls(message: ContentDelta) -> list[tuple[str, dict]]:
    for call in message.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def check_everywhere(new_parser, text: str, content: str, expected_calls: list, reason: str) -> None:
    for pieces in (1, 2, 5, len(text)):
        for seed in range(3 if 1 < pieces < len(text) else 1):
            message, final = run(new_parser(), text, pieces, seed)
            assert message.content == content, (pieces, seed)
            assert calls(message) == expected_calls, (pieces, seed)
            assert final == reason


def whole_parser(name: str, tools: list | None = None):
    return lambda: tool_parsers.FORMATS[name].new_parser(tools or [], False)


def streamed_parser(name: str, tools: list | None = None):
    return lambda: tool_parsers.FORMATS[name].new_parser(tools or [], True)


HERMES_CASES = [
    ("Hello there, no tools needed.", "Hello there, no tools needed.", [], "stop"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "days": 3})], "tool_calls"),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": "é \\"q\\""}}\n</tool_call>',
     "", [("a", {}), ("b", {"x": 'é "q"'})], "tool_calls"),
    ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"k": [1, {"z": "}"}]}}\n</tool_call>',
     "Let me check.\n", [("f", {"k": [1, {"z": "}"}]})], "tool_calls"),
    ('<tool_call>\n{"name": "f", "arguments": {"k": 1</tool_call> oops',
     '<tool_call>\n{"name": "f", "arguments": {"k": 1</tool_call> oops', [], "stop"),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', [], "stop"),
    ('a < b <tool <tool_call>\n{"name": "f", "arguments": "{\\"k\\": 2}"}', "a < b <tool ", [("f", {"k": 2})], "tool_calls"),
]


@pytest.mark.parametrize("text,content,expected,reason", HERMES_CASES)
def test_hermes(text: str, content: str, expected: list, reason: str) -> None:
    check_everywhere(whole_parser("hermes"), text, content, expected, reason)
    if expected and content == "" and "</tool_call>" in text:  # well-formed calls stream to the same message
        check_everywhere(streamed_parser("hermes"), text, content, expected, reason)


LLAMA_CASES = [
    ("The answer is 4.", "The answer is 4.", [], "stop"),
    ('{"name": "get_weather", "parameters": {"city": "Tokyo"}}', "", [("get_weather", {"city": "Tokyo"})], "tool_calls"),
    (' <|python_tag|>{"name": "a", "parameters": {"s": "x;y}"}}; {"name": "b", "arguments": {}}', "",
     [("a", {"s": "x;y}"}), ("b", {})], "tool_calls"),
    ('{"name": "f", "parameters": {"k": }', '{"name": "f", "parameters": {"k": }', [], "stop"),
    ('{"value": 3} is JSON', '{"value": 3} is JSON', [], "stop"),
    ('{"name": "f", "parameters": {"k": 1', '{"name": "f", "parameters": {"k": 1', [], "stop"),
]


@pytest.mark.parametrize("text,content,expected,reason", LLAMA_CASES)
def test_llama3_json(text: str, content: str, expected: list, reason: str) -> None:
    check_everywhere(whole_parser("llama3_json"), text, content, expected, reason)
    if expected or "name" not in text:
        check_everywhere(streamed_parser("llama3_json"), text, content, expected, reason)


MISTRAL_CASES = [
    ("No tools here.", "No tools here.", [], "stop"),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "b", "arguments": {}}]',
     "", [("get_weather", {"city": "Paris", "days": 3}), ("b", {})], "tool_calls"),
    ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "q": "a}[b"}[TOOL_CALLS]b[CALL_ID]x1y2z3w4v[ARGS]{}',
     "Checking.", [("get_weather", {"city": "Nice", "q": "a}[b"}), ("b", {})], "tool_calls"),
]


@pytest.mark.parametrize("text,content,expected,reason", MISTRAL_CASES)
def test_mistral(text: str, content: str, expected: list, reason: str) -> None:
    check_everywhere(streamed_parser("mistral"), text, content, expected, reason)


PYTHONIC_CASES = [
    ("Just text (with parens).", "Just text (with parens).", [], "stop"),
    ('[get_weather(city="San Francisco, CA", days=3), search(q=\'a)b\', tags=["x", "y"], deep={"k": None}), now()]',
     "", [("get_weather", {"city": "San Francisco, CA", "days": 3}),
          ("search", {"q": "a)b", "tags": ["x", "y"], "deep": {"k": None}}), ("now", {})], "tool_calls"),
    ('<|python_start|>[f(flag=True)]<|python_end|>', "", [("f", {"flag": True})], "tool_calls"),
]


@pytest.mark.parametrize("text,content,expected,reason", PYTHONIC_CASES)
def test_pythonic(text: str, content: str, expected: list, reason: str) -> None:
    check_everywhere(streamed_parser("pythonic"), text, content, expected, reason)


CODER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}},
}}}]
CODER_CASES = [
    ("Plain <b>text</b>.", "Plain <b>text</b>.", [], "stop"),
    ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=now>\n</function>\n</tool_call>",
     "Let me look.\n", [("get_weather", {"city": "Paris", "days": 3, "zip": "75001"}), ("now", {})], "tool_calls"),
    ("<tool_call>\n<function=note>\n<parameter=text>\nline one\n<b>two</b>\n</parameter>\n</function>\n</tool_call>",
     "", [("note", {"text": "line one\n<b>two</b>"})], "tool_calls"),
]


@pytest.mark.parametrize("text,content,expected,reason", CODER_CASES)
def test_qwen3_coder(text: str, content: str, expected: list, reason: str) -> None:
    check_everywhere(streamed_parser("qwen3_coder", CODER_TOOLS), text, content, expected, reason)


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'),
    ("pythonic", '[get_weather(city="Paris", days=3)]'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
])
def test_streamed_arguments_arrive_in_openai_delta_form(name: str, text: str) -> None:
    """Fed a character at a time: the first chunk of the call carries its id,
    type and name (arguments empty), the later ones only argument text."""
    processor = streamed_parser(name, CODER_TOOLS)()
    chunks = []
    for ch in text:
        chunks += processor.feed(ch).tool_calls
    rest, reason = processor.finish("stop")
    chunks += rest.tool_calls
    head, *tail = chunks
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert len(tail) >= 2 and all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in tail)
    assert json.loads("".join(c["function"]["arguments"] for c in tail)) == {"city": "Paris", "days": 3}
    assert reason == "tool_calls"


def test_a_length_stop_is_reported_as_length() -> None:
    message, reason = run(whole_parser("hermes")(), '<tool_call>\n{"name": "f", "arg', 3, reason="length")
    assert reason == "length" and not message.tool_calls


def test_forced_calls_stream_their_arguments() -> None:
    text = '{"city": "Paris", "days": 2}'
    for pieces in (1, 4, len(text)):
        processor = NamedCall("get_weather")
        first = processor.feed(text[:1])
        assert first.tool_calls[0]["function"]["name"] == "get_weather" and first.tool_calls[0]["id"].startswith("call_")
        message = ContentDelta()
        message.merge(first)
        message2, reason = run(processor, text[1:], pieces)
        message.merge(message2)
        assert calls(message) == [("get_weather", {"city": "Paris", "days": 2})] and reason == "tool_calls"
    array = '[{"name": "a", "parameters": {"s": "]}"}}, {"name": "b", "parameters": {}}]'
    for pieces in (1, 7, len(array)):
        message, reason = run(RequiredCalls(), array, pieces, seed=pieces)
        assert calls(message) == [("a", {"s": "]}"}), ("b", {})] and reason == "tool_calls"


def test_required_calls_stream_their_arguments_in_pieces_like_a_named_choice() -> None:
    """tool_choice "required", fed a character at a time: each call's first
    chunk carries its index, id, type and name, the later ones argument text."""
    array = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "b", "parameters": {}}]'
    processor = RequiredCalls()
    chunks = [c for ch in array for c in processor.feed(ch).tool_calls]
    rest, reason = processor.finish("stop")
    assert not rest.tool_calls and reason == "tool_calls"
    first = [c for c in chunks if c["index"] == 0]
    head, *tail = first
    assert head["id"].startswith("call_") and head["function"] == {"name": "get_weather", "arguments": ""}
    assert len(tail) >= 2 and all(set(c["function"]) == {"arguments"} for c in tail)
    assert json.loads("".join(c["function"]["arguments"] for c in tail)) == {"city": "Paris", "days": 3}
    second = [c for c in chunks if c["index"] == 1]
    assert second[0]["function"]["name"] == "b" and "".join(c["function"]["arguments"] for c in second) == "{}"


def test_a_required_call_cut_by_length_keeps_length() -> None:
    processor = RequiredCalls()
    out = processor.feed('[{"name": "get_weather", "parameters": {"city": "Par')
    assert out.tool_calls[0]["function"]["name"] == "get_weather"
    assert processor.finish("length")[1] == "length"


def _real_tokenizer(name: str, root: Path):
    """Qwen3's or Llama 3's tokenizer: its real chat template and special
    tokens over a small vocabulary (tests/real_vocab_models.py)."""
    from transformers import AutoTokenizer

    build_fixture_tokenizer(name, root / name)
    return AutoTokenizer.from_pretrained(str(root / name))


def test_detection_from_real_templates(tmp_path: Path) -> None:
    qwen = _real_tokenizer("qwen3", tmp_path).chat_template
    llama = _real_tokenizer("llama3", tmp_path).chat_template
    assert tool_parsers.detect(qwen) == "hermes"
    assert tool_parsers.detect(llama) is None  # Llama 3.0's template knows no tools
    assert tool_parsers.resolve("llama3", llama).name == "llama3_json"
    assert tool_parsers.resolve("none", qwen) is None


def test_templates_that_ignore_tools_get_them_in_the_system_message(tmp_path: Path) -> None:
    tokenizer = _real_tokenizer("llama3", tmp_path)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    plan = ToolPlan("auto", [tool], format=tool_parsers.FORMATS["llama3_json"])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prompt = tokenizer.apply_chat_template(
        template_messages(plan, messages, tokenizer.chat_template), tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather"' in prompt and "Given the following functions" in prompt
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt and "sunny" in prompt
    # A template that renders tools itself gets the messages unchanged.
    assert template_messages(plan, messages, "{{ tools }}") is messages


def test_cli_choices_match_the_parsers() -> None:
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    assert set(fields["tool_call_parser"].metadata["choices"]) == set(tool_parsers.CHOICES)
    assert set(fields["reasoning_parser"].metadata["choices"]) == set(REASONING_PARSERS)
