"""SGLang's native POST /generate: its response bodies, as SGLang's
io_struct writes them (the request body is intake/generate_request.py)."""

from __future__ import annotations

from pydantic import RootModel

from aioserve.server.wire import WireModel

# [logprob, token id, token text or null]: SGLang's logprob entries.
LogprobEntry = tuple[float | None, int, str | None]


class FinishReason(WireModel):
    omit_when_none = ("matched", "length", "message")

    type: str  # stop | length | abort
    matched: int | str | None = None  # for stop: the token id or the stop string
    length: int | None = None
    message: str | None = None


class MetaInfo(WireModel):
    omit_when_none = (
        "input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs",
        "spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts", "spec_accept_length",
    )

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    # With speculative decoding on (SGLang's names): steps that gave tokens,
    # tokens proposed and verified, those that stood, tokens a step.
    spec_verify_ct: int | None = None
    spec_num_proposed_drafts: int | None = None
    spec_num_correct_drafts: int | None = None
    spec_accept_length: float | None = None


class GenerateOutput(WireModel):
    """One prompt's (or one of its n samples') result; in a stream, the
    result so far, text and ids cumulative, as SGLang streams them."""

    omit_when_none = ("index",)

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None  # in a stream of several outputs: whose this event is


class GenerateBatch(RootModel[list[GenerateOutput]]):
    pass
