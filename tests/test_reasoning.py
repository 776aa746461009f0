"""Reasoning parsers on hand-written outputs, whole and in random pieces,
alone and in front of a tool-call parser."""

from __future__ import annotations

import json

import pytest

from aioserve.server.output import tool_parsers
from aioserve.server.output.reasoning import Chained, new_reasoning_parser
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


class _Inner:
    """A grammar that allows only token 7, then is done."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row].zero_()
        bitmask[row, 0] = 1 << 7

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id == 7

    def is_terminated(self) -> bool:
        return self.accepted == [7]

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]


def test_a_deferred_grammar_starts_after_the_end_of_reasoning() -> None:
    import torch

    from aioserve.grammar.after_reasoning import AfterReasoning

    inner = _Inner()
    factory = type("F", (), {"new_constraint": lambda self, stop: inner})()
    constraint = AfterReasoning(factory, [40, 41]).new_constraint([2])
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    for token in (5, 40, 9, 41, 40):  # "40 41" only ends it when adjacent
        constraint.fill_bitmask(bitmask, 0)
        assert bitmask.eq(-1).all() and not constraint.is_terminated()  # free while thinking
        assert constraint.accept(token)
    assert constraint.accept(41)  # the end of the thought: the grammar begins
    constraint.fill_bitmask(bitmask, 0)
    assert bitmask[0, 0] == 1 << 7 and bitmask[0, 1] == 0
    inner.accepted.clear()
    assert constraint.accept(7) and constraint.is_terminated()
    assert inner.accepted == [7]  # the thought never reached the grammar


def test_a_forced_call_after_a_thought() -> None:
    from aioserve.server.output.tool_parsers.forced import NamedCall

    text = '<think>\nWeather, so call it.\n</think>\n\n{"city": "Paris"}'
    for pieces in (1, 5, len(text)):
        message, reason = run(Chained(new_reasoning_parser("qwen3"), NamedCall("get_weather")), text, pieces, seed=pieces)
        assert message.reasoning_content == "Weather, so call it."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
