"""SGLang's native POST /generate: its request body (the response bodies
are output/generate_bodies.py).

Names and defaults are SGLang's (io_struct.GenerateReqInput and its
sampling params), so SGLang clients and scripts work unchanged. As with the
OpenAI bodies, unknown fields are ignored and null means the default; what
SGLang supports and we do not (structural tags) is refused with a 400. The
ranges are the engine's own, wider than OpenAI's where SGLang's are
(aioserve/sampling_limits.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from pydantic import Field, field_validator

from aioserve.sampling_limits import GENERATE_BOUNDS
from aioserve.sampling_params import SamplingParams, StructuredOutputParams
from aioserve.server.intake.generation_defaults import or_default
from aioserve.server.intake.request_model import RequestModel, bounded, check_logit_bias_keys
from aioserve.server.intake.structured import StructuredRequest, one_constraint
from aioserve.server.intake.unhonoured_fields import GENERATE_FIELDS


class GenerateSamplingParams(RequestModel):
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = bounded(0, GENERATE_BOUNDS["min_tokens"])
    temperature: float = bounded(1.0, GENERATE_BOUNDS["temperature"])
    top_p: float = bounded(1.0, GENERATE_BOUNDS["top_p"])
    top_k: int = bounded(-1, GENERATE_BOUNDS["top_k"])
    min_p: float = bounded(0.0, GENERATE_BOUNDS["min_p"])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    presence_penalty: float = bounded(0.0, GENERATE_BOUNDS["presence_penalty"])
    frequency_penalty: float = bounded(0.0, GENERATE_BOUNDS["frequency_penalty"])
    repetition_penalty: float = bounded(1.0, GENERATE_BOUNDS["repetition_penalty"])
    n: int = bounded(1, GENERATE_BOUNDS["n"])
    sampling_seed: int | None = None
    seed: int | None = None  # what OpenAI-minded clients send
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @field_validator("structural_tag")
    @classmethod
    def _unsupported(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("structural tags are not supported by this server (json_schema, regex and ebnf are)")
        return value

    def structured(self) -> StructuredRequest | None:
        given = [
            StructuredRequest(StructuredOutputParams(**{kind: cast(Any, value)}), f"sampling_params.{field}")
            for field, kind, value in (
                ("json_schema", "json", self.json_schema), ("regex", "regex", self.regex),
                ("ebnf", "grammar", self.ebnf),
            )
            if value is not None
        ]
        return one_constraint(given, "give one of json_schema, regex and ebnf")

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias_keys(value)


class GenerateRequest(RequestModel):
    unhonoured = GENERATE_FIELDS

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = bounded(0, GENERATE_BOUNDS["logprobs"])
    logprob_start_len: int = Field(-1, ge=-1)  # -1: no prompt logprobs
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # the LoRA adapter's name, or one per prompt
    # A vision-language model's images (URLs, data URLs, local files), SGLang's
    # shapes: one prompt's image or list of them; for a batch, one entry
    # (an image, a list of them or null) per prompt. The text holds the
    # model's image marker once per image (server/intake/image_parts.py).
    image_data: str | list[str | list[str] | None] | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's generation config, for the unset sampling fields."""
        sp = self.sampling_params
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        top_k = or_default(sp, "top_k", defaults, -1)
        return SamplingParams(
            max_tokens=sp.max_new_tokens,
            temperature=or_default(sp, "temperature", defaults, 1.0),
            top_p=or_default(sp, "top_p", defaults, 1.0),
            top_k=-1 if top_k == 0 else top_k,
            min_p=or_default(sp, "min_p", defaults, 0.0),
            seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
            stop=stop,
            stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_new_tokens,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs=self.top_logprobs_num if self.wants_prompt_logprobs else None,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=or_default(sp, "repetition_penalty", defaults, 1.0),
            logit_bias={int(k): v for k, v in (sp.logit_bias or {}).items()},
            skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
            structured_outputs=constraint.spec if (constraint := sp.structured()) else None,
        )


# Where SamplingParams.validate and the scheduler name a field, and where
# SGLang's request has it.
PARAM_NAMES = {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    **{
        name: f"sampling_params.{name}"
        for name in (
            "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "logit_bias",
        )
    },
}


def sglang_param(param: str | None, prompt_field: str) -> str | None:
    if param == "prompt":
        return prompt_field
    return PARAM_NAMES.get(param or "", param)
