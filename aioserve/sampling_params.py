"""Per-request sampling and stopping settings.

Plain data at the bottom of the dependency graph: imports nothing of the
project but the table of ranges (sampling_limits.py), so the server, the
scheduler and the offline API can all share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aioserve.sampling_limits import BOUNDS, MAX_TOP_LOGPROBS


class SamplingParamsError(ValueError):
    """A bad sampling setting; `param` names the offending request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputParams:
    """What the output must match; exactly one field is set. The grammar is
    compiled (by the server or the offline API, which know the vocabulary)
    before the request reaches the scheduler.

    * `json`: a JSON schema (a dict, a boolean schema, or its JSON text);
    * `json_object`: any JSON object;
    * `regex`: the whole output matches it;
    * `choice`: the output is one of these strings;
    * `grammar`: an EBNF grammar (xgrammar's GBNF dialect, `root ::= ...`).
    """

    json: dict[str, Any] | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kind(self) -> str:
        """The one field that is set; SamplingParamsError if none or several."""
        given = [
            name
            for name, value in (
                ("json", self.json), ("json_object", self.json_object or None), ("regex", self.regex),
                ("choice", self.choice), ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise SamplingParamsError(
                f"structured output takes exactly one of json, json_object, regex, choice, grammar (got {what})",
                "structured_outputs",
            )
        return given[0]

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint, for caching its compiled grammar."""
        kind = self.kind()
        if kind == "json":
            # One key for a schema however it is spaced; key order is kept
            # (properties are generated in the schema's order).
            schema = self._parsed_schema()
            if isinstance(schema, str):
                return kind, schema  # not JSON: compiling it reports the error
            return kind, json.dumps(schema)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))

    def _parsed_schema(self) -> Any:
        """The schema as data; text that is not JSON stays text."""
        if isinstance(self.json, str):
            try:
                return json.loads(self.json)
            except json.JSONDecodeError:
                return self.json
        return self.json

    def validate(self) -> None:
        kind = self.kind()
        if kind == "choice" and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("choice must be a non-empty list of non-empty strings", "structured_outputs.choice")
        if kind in ("regex", "grammar") and not getattr(self, kind):
            raise SamplingParamsError(f"{kind} must not be empty", f"structured_outputs.{kind}")
        if kind == "json":
            if (ref := _remote_ref(self._parsed_schema())) is not None:
                raise SamplingParamsError(
                    f"the JSON schema refers to {ref!r}: remote $ref targets are never fetched; inline the "
                    "definition (or refer to it inside the schema, as #/$defs/...)", "structured_outputs.json",
                )


def _remote_ref(schema: Any) -> str | None:
    """The first "$ref" that points outside the schema (anything but "#..."),
    which the grammar compiler would otherwise silently leave unconstrained."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: until the context (or the KV pool) is full; 0: score the prompt only
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; 0: the chosen token's; N: plus top N
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding: the output follows a grammar (see StructuredOutputParams).
    structured_outputs: StructuredOutputParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    # Below this a temperature is greedy, as in vLLM: dividing logits by 1e-45
    # overflows to infinity, and the softmax of that has no mass to sample.
    MIN_SAMPLING_TEMPERATURE = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature < self.MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError for any value a sampler cannot honour
        (the ranges: sampling_limits.BOUNDS)."""
        if self.max_tokens is not None and self.max_tokens < 0:
            raise SamplingParamsError("max_tokens must not be negative", "max_tokens")
        self._check_range("temperature", "top_p")
        if self.top_k not in BOUNDS["top_k"]:  # past the vocabulary it is off; past int32 it is a mistake
            raise SamplingParamsError("top_k must be -1 (off) or a positive integer below 2**31", "top_k")
        self._check_range("min_p")
        if self.min_tokens not in BOUNDS["min_tokens"]:
            raise SamplingParamsError("min_tokens must be non-negative", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens must not exceed max_tokens", "min_tokens")
        self._check_range("presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value not in BOUNDS[name]:
                raise SamplingParamsError(
                    f"{name} must be between 0 and {MAX_TOP_LOGPROBS}", name
                )
        if self.seed is not None and self.seed not in BOUNDS["seed"]:
            raise SamplingParamsError("seed must fit in 64 bits", "seed")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must not be empty", "stop")
        for bias in self.logit_bias.values():
            if bias not in BOUNDS["logit_bias"]:
                raise SamplingParamsError(f"logit_bias values must be in {BOUNDS['logit_bias']}", "logit_bias")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if vocab_size is not None:
            for name, ids in (
                ("stop_token_ids", self.stop_token_ids),
                ("logit_bias", list(self.logit_bias)),
            ):
                if any(not 0 <= t < vocab_size for t in ids):
                    raise SamplingParamsError(
                        f"{name} holds a token id outside [0, {vocab_size})", name
                    )

    def _check_range(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) not in BOUNDS[name]:
                raise SamplingParamsError(f"{name} must be in {BOUNDS[name]}", name)
