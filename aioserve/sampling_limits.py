"""The ranges of the sampling fields, in one table that every check reads:
SamplingParams.validate checks BOUNDS on every request, whatever route (or
the offline API) it came by, and each route's request models (the server's
intake/) declare their ranges from here, so that a value out of range is a
400 at validation, before any tokenizing or grammar compiling, and
/openapi.json shows the range.

Per route, drawn as vLLM and SGLang draw them:

* OpenAI's routes (completions, chat, responses) take OpenAI's documented
  ranges (OPENAI_BOUNDS): temperature 0 to 2, as OpenAI's API and vLLM's
  OpenAI server bound it. A client written against OpenAI sends nothing
  outside them.
* SGLang's native /generate takes the engine's own (GENERATE_BOUNDS, which
  is BOUNDS): SGLang bounds temperature only below, so its clients may send
  more than OpenAI's 2; the most the engine takes (100) is the most this
  route can honour, and what /generate already answered 400 above.

Plain data at the bottom, beside sampling_params.py: it imports nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Bound:
    """An interval, closed unless a side is marked open; None: no bound on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        """As the error messages write it: "[0, 2]", "(0, 1]"."""
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


MAX_TOP_LOGPROBS = 20  # top logprobs per position, for the output and for the prompt

# Every request, every route: the engine's ranges (and n, the choices per prompt).
BOUNDS: Mapping[str, Bound] = MappingProxyType({
    "temperature": Bound(0.0, 100.0),
    "top_p": Bound(0.0, 1.0, low_open=True),
    "top_k": Bound(-1, 2**31, high_open=True),  # -1 or 0: off; past the vocabulary, off too; past int32 a mistake
    "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, 2.0, low_open=True),
    "min_tokens": Bound(0),
    "logprobs": Bound(0, MAX_TOP_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_TOP_LOGPROBS),
    "logit_bias": Bound(-100.0, 100.0),  # each value
    "seed": Bound(-(2**63), 2**64, high_open=True),
    "n": Bound(1, 128),
})

# /v1/completions, /v1/chat/completions, /v1/responses.
OPENAI_BOUNDS: Mapping[str, Bound] = MappingProxyType({**BOUNDS, "temperature": Bound(0.0, 2.0)})

# SGLang's /generate.
GENERATE_BOUNDS: Mapping[str, Bound] = BOUNDS
