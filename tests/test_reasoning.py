"""Reasoning parsers on hand-written outputs, whole and in random pieces,
alone and in front of a tool-call parser."""

from __future__ import annotations

import pytest

from aioserve.server import tool_parsers
from aioserve.server.reasoning import Chained, new_reasoning_parser
from test_tool_parsers import calls, run

CASES = [
    # parser, output, reasoning, content
    ("qwen3", "<think>\nLet me think.\nStill thinking.\n</think>\n\nThe answer is 4.", "Let me think.\nStill thinking.", "The answer is 4."),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),  # enable_thinking: false
    ("qwen3", "<think>\nno end in sight", "no end in sight", ""),
    ("qwen3", "<thinking> is not a tag", "", "<thinking> is not a tag"),
    ("qwen3", "<think></think>", "", ""),
    ("deepseek_r1", "Reasoning first.\n</think>\n\nAnswer.", "Reasoning first.", "Answer."),
    ("deepseek_r1", "<think>Reasoning.</think>Answer.", "Reasoning.", "Answer."),
    ("deepseek_r1", "All reasoning, cut short", "All reasoning, cut short", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_reasoning_split(name: str, text: str, reasoning: str, content: str) -> None:
    for pieces in (1, 3, 6, len(text)):
        for seed in range(3):
            message, reason = run(new_reasoning_parser(name), text, pieces, seed)
            assert (message.reasoning_content, message.content) == (reasoning, content), (pieces, seed)
            assert reason == "stop"


def test_reasoning_then_tool_calls() -> None:
    text = '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {"c": "P"}}\n</tool_call>'
    for pieces in (1, 4, len(text)):
        processor = Chained(new_reasoning_parser("qwen3"), tool_parsers.FORMATS["hermes"].new_parser([], False))
        message, reason = run(processor, text, pieces, seed=pieces)
        assert message.reasoning_content == "The user wants weather."
        assert message.content == "" and calls(message) == [("w", {"c": "P"})] and reason == "tool_calls"


def test_unknown_parser() -> None:
    with pytest.raises(ValueError):
        new_reasoning_parser("nope")
