"""Speculative decoding's settings, from the flags vLLM and SGLang users type.

vLLM: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}'` (the Python API's
`speculative_config=` takes the same dict). SGLang: `--speculative-algorithm
NGRAM --speculative-num-draft-tokens 5` (SGLang counts the verified position
as a draft token: N draft tokens are N - 1 proposed ones) or
`--speculative-num-steps K`. Both resolve to one `SpeculativeConfig`.

A draft model: vLLM's `{"method": "draft_model", "model": PATH,
"num_speculative_tokens": k}` (or `{"model": PATH}` alone), SGLang's
`--speculative-algorithm STANDALONE --speculative-draft-model-path PATH`.
The draft runs inside the engine's step (engine/draft_runner.py), on every
rank under tensor parallelism, sharded as the target is; the loader checks
the draft shares the target's vocabulary.

An EAGLE-3 head: vLLM's `{"method": "eagle3", "model": PATH,
"num_speculative_tokens": k}`, SGLang's `--speculative-algorithm EAGLE3
--speculative-draft-model-path PATH` (EAGLE too: the same heads). It runs
inside the step as well (engine/eagle3_runner.py), sharded likewise.

It imports only config.py (the flags are EngineConfig fields, so the CLI
offers them): the loader checks them at start and the scheduler reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioserve.config import ConfigError, EngineConfig

METHODS = ("ngram", "draft_model", "eagle3")
# Methods whose proposals come from a second checkpoint ("model").
WITH_MODEL = {"draft_model": "the draft's checkpoint", "eagle3": "the EAGLE-3 head's checkpoint"}
# SGLang's --speculative-algorithm names -> vLLM's methods.
SGLANG_ALGORITHMS = {"NGRAM": "ngram", "STANDALONE": "draft_model", "EAGLE3": "eagle3", "EAGLE": "eagle3"}
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}

DEFAULT_NUM_TOKENS = 4
DEFAULT_LOOKUP_MAX = 4
# One matching token proposes too often and too wrongly: on the demo model's
# self-quoting prompts (benchmarks/speculative.py, concurrency 1) a 1-token
# minimum kept 1.28 tokens a verification and ran at 0.95x plain decoding,
# a 2-token one kept 2.0 and ran at 1.05x.
DEFAULT_LOOKUP_MIN = 2
# Past this many decoding requests a step verifies no drafts: the batch is
# bound by its matmuls already, and k + 1 rows a request multiply the work
# (benchmarks/speculative.py measures where the gain ends).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_tokens: int  # k: tokens proposed per request and step
    lookup_max: int = DEFAULT_LOOKUP_MAX  # ngram: longest suffix matched
    lookup_min: int = DEFAULT_LOOKUP_MIN  # ngram: shortest suffix matched
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_model: str | None = None


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"speculative decoding: {name} must be a positive integer, got {value!r}")
    return value


def from_dict(spec: dict[str, Any]) -> SpeculativeConfig:
    """vLLM's --speculative-config object."""
    unknown = set(spec) - _KEYS
    if unknown:
        raise ConfigError(f"--speculative-config: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method not in METHODS:
        raise ConfigError(f"--speculative-config: method must be one of {', '.join(METHODS)}, got {method!r}")
    if method in WITH_MODEL and not spec.get("model"):
        raise ConfigError(
            f'speculative decoding method "{method}" needs {WITH_MODEL[method]}: "model": PATH in '
            "--speculative-config, or SGLang's --speculative-draft-model-path"
        )
    lookup_max = _positive("prompt_lookup_max", spec.get("prompt_lookup_max", DEFAULT_LOOKUP_MAX))
    lookup_min = _positive("prompt_lookup_min", spec.get("prompt_lookup_min", min(DEFAULT_LOOKUP_MIN, lookup_max)))
    if lookup_min > lookup_max:
        raise ConfigError(f"speculative decoding: prompt_lookup_min {lookup_min} exceeds prompt_lookup_max {lookup_max}")
    return SpeculativeConfig(
        method=method,
        num_tokens=_positive("num_speculative_tokens", spec.get("num_speculative_tokens", DEFAULT_NUM_TOKENS)),
        lookup_max=lookup_max,
        lookup_min=lookup_min,
        disable_by_batch_size=_positive(
            "disable_by_batch_size", spec.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        ),
        draft_model=spec.get("model"),
    )


def resolve_speculative(config: EngineConfig) -> SpeculativeConfig | None:
    """The speculative settings the flags ask for, or None (plain decoding).
    vLLM's object and SGLang's flags are two spellings: give one of them."""
    sglang = config.speculative_algorithm is not None
    if config.speculative_config is not None and sglang:
        raise ConfigError("give --speculative-config (vLLM's) or --speculative-algorithm (SGLang's), not both")
    if config.speculative_config is not None:
        return from_dict(dict(config.speculative_config))
    if not sglang:
        if config.speculative_num_draft_tokens is not None or config.speculative_num_steps is not None:
            raise ConfigError("--speculative-num-draft-tokens and --speculative-num-steps need --speculative-algorithm")
        return None
    algorithm = str(config.speculative_algorithm).upper()
    if algorithm not in SGLANG_ALGORITHMS:
        raise ConfigError(
            f"--speculative-algorithm {config.speculative_algorithm}: choose from {', '.join(SGLANG_ALGORITHMS)}"
        )
    spec: dict[str, Any] = {"method": SGLANG_ALGORITHMS[algorithm]}
    if config.speculative_draft_model_path is not None:
        spec["model"] = config.speculative_draft_model_path
    if config.speculative_num_draft_tokens is not None:  # SGLang counts the verified token too
        spec["num_speculative_tokens"] = _positive("--speculative-num-draft-tokens", config.speculative_num_draft_tokens - 1)
    elif config.speculative_num_steps is not None:
        spec["num_speculative_tokens"] = config.speculative_num_steps
    return from_dict(spec)
