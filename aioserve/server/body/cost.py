"""What a request's response may hold, estimated from its raw JSON before any
work: checks.py holds the estimate to the per-request budgets.

Each per-request bound holds alone, but a response multiplies them: 8
prompts of 500 tokens × n=128 × echo × 21 logprobs a token is 10 million
logprob entries (~270 MB of JSON) from a 19 KB body, and echo alone copies
every prompt into each of its n choices, which costs no generation at all.

Standard library only, and nothing of aioserve (body/worker.py runs this
beside checks.py as plain scripts). A prompt's tokens are counted as its
characters (an estimate before tokenizing, never below the truth for
text); shapes that are wrong are left to pydantic's validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResponseCost:
    """Upper bounds on one response, and the fields to name when refusing."""

    logprob_entries: int  # prompts × n × (echoed prompt + max tokens) × (1 + top logprobs), prompt_logprobs too
    text_tokens: int  # prompts × n × (echoed prompt + max tokens): the response's text
    text_param: str  # the field that makes most of text_tokens: the echo, or the max tokens
    output_unset: bool  # the max tokens were not given and count as the context


@dataclass(frozen=True)
class _Shape:
    """A route's fields, read alike: completions, chat, /generate."""

    prompts: int
    prompt_tokens: int  # all prompts' tokens together
    n: int
    output: int  # max tokens per choice as the route defaults them (chat: 0 when unset)
    output_param: str
    output_unset: bool  # chat without max_tokens: its choices may run to the context
    echoed_text: int  # tokens of text echoed before each choice's output (all prompts together)
    top: int  # top logprobs per token, -1 without logprobs
    logprobs_echo: bool  # the echoed prompt carries logprobs too
    prompt_logprobs_copies: int = 1  # completions give each choice its own prompt_logprobs


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _n(fields: dict[str, Any]) -> int:
    return _int(fields.get("n"), 1)


def _prompt_tokens(prompt: Any) -> tuple[int, int]:
    """(prompts, their tokens together) of a prompt field: a string, token
    ids, or a list of either."""
    if isinstance(prompt, str):
        return 1, len(prompt)
    if not isinstance(prompt, list) or not prompt:
        return 1, 0
    if not isinstance(prompt[0], (list, str)):
        return 1, len(prompt)
    return len(prompt), sum(len(p) for p in prompt if isinstance(p, (list, str)))


def _text(content: Any) -> int:
    """Characters of a message's content: a string, or parts with text."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def _chat_chars(messages: Any) -> int:
    """Characters of the messages' text: their tokens, estimated."""
    return sum(_text(m.get("content")) for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0


def _chat_echo(data: dict[str, Any]) -> int:
    """vLLM's chat echo: each choice begins with the final message's text
    when that is the assistant's."""
    messages = data.get("messages")
    if data.get("echo") is not True or not isinstance(messages, list) or not messages:
        return 0
    last = messages[-1]
    return _text(last.get("content")) if isinstance(last, dict) and last.get("role") == "assistant" else 0


def _shape(data: dict[str, Any], sampling: dict[str, Any]) -> _Shape:
    if "messages" in data:  # chat: logprobs (bool) and top_logprobs
        given = "max_completion_tokens" if data.get("max_completion_tokens") else "max_tokens"
        output = _int(data.get(given))
        return _Shape(
            prompts=1, prompt_tokens=_chat_chars(data["messages"]), n=_n(data), output=output,
            output_param=given, output_unset=output == 0, echoed_text=_chat_echo(data),
            top=_int(data.get("top_logprobs")) if data.get("logprobs") is True else -1, logprobs_echo=False,
        )
    if "sampling_params" in data or "input_ids" in data or "text" in data:  # /generate: no echo of text
        prompts, tokens = _prompt_tokens(data.get("input_ids") if data.get("input_ids") else data.get("text"))
        top = _int(data.get("top_logprobs_num")) if data.get("return_logprob") is True else -1
        start = data.get("logprob_start_len")
        return _Shape(
            prompts=prompts, prompt_tokens=tokens, n=_n(sampling), output=_int(sampling.get("max_new_tokens"), 128),
            output_param="sampling_params.max_new_tokens", output_unset=False, echoed_text=0, top=top,
            logprobs_echo=top >= 0 and isinstance(start, int) and not isinstance(start, bool) and start >= 0,
        )
    prompts, tokens = _prompt_tokens(data.get("prompt"))  # completions: logprobs (int) and echo
    logprobs = data.get("logprobs")
    top = logprobs if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs >= 0 else -1
    echo = data.get("echo") is True
    return _Shape(
        prompts=prompts, prompt_tokens=tokens, n=_n(data), output=_int(data.get("max_tokens"), 16),
        output_param="max_tokens", output_unset=False, echoed_text=tokens if echo else 0, top=top,
        logprobs_echo=echo and top >= 0, prompt_logprobs_copies=_n(data),
    )


def estimate(data: dict[str, Any], context_tokens: int) -> ResponseCost:
    """The response's bounds. `context_tokens`, the model's context (0 when
    unknown), caps each choice's output: a max_tokens past it is a 400 of
    its own, and a chat request without one may generate up to it."""
    sampling = data.get("sampling_params")
    shape = _shape(data, sampling if isinstance(sampling, dict) else {})
    choices = shape.prompts * shape.n
    entries = 0
    if shape.top >= 0:  # an unset chat max_tokens counts 0 here (b6df7ee's estimate, as it was)
        echoed = shape.prompt_tokens if shape.logprobs_echo else 0
        entries += shape.n * (shape.prompts * shape.output + echoed) * (1 + shape.top)
    prompt_top = data.get("prompt_logprobs")
    if isinstance(prompt_top, int) and not isinstance(prompt_top, bool) and prompt_top >= 0:
        entries += shape.prompt_logprobs_copies * shape.prompt_tokens * (1 + prompt_top)
    output = shape.output or (context_tokens if shape.output_unset else 0)
    if context_tokens:
        output = min(output, context_tokens)
    echoed_text = shape.n * shape.echoed_text
    text_tokens = choices * output + echoed_text
    return ResponseCost(
        logprob_entries=entries, text_tokens=text_tokens,
        text_param="echo" if echoed_text > choices * output else shape.output_param,
        output_unset=shape.output_unset and output > 0,
    )
