"""From a request's scheduler events to what a client sees: text deltas
(incrementally detokenized, cut at stop strings), token ids, logprobs, the
finish reason and usage. Shared by the HTTP handlers and the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from aioserve.sampling_params import SamplingParams
from aioserve.scheduler.request import RequestEvent
from aioserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

TopLogprobs = list[tuple[int, float]]


@dataclass
class OutputDelta:
    """What changed since the last delta."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs | None] = []
        self.finish_reason: str | None = None
        self.stop_string_hit = False  # the consumer must then end the request (scheduler.abort(.., "stop"))
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: RequestEvent, delta: OutputDelta | None = None) -> OutputDelta:
        """Fold one event into the stream (and into `delta`, to group several)."""
        delta = delta or OutputDelta()
        if self.finished:
            return delta  # tokens computed after a stop string, or a late abort echo
        if event.num_cached_tokens is not None:
            self.num_cached_tokens = event.num_cached_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.error:
            self.error = event.error
        text = ""
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            self.logprobs.append(event.logprob)  # type: ignore[arg-type]
            self.top_logprobs.append(event.top_logprobs)
            delta.token_ids.append(event.token_id)
            delta.logprobs.append(event.logprob)  # type: ignore[arg-type]
            delta.top_logprobs.append(event.top_logprobs)
            text, self.stop_string_hit = self._stops.feed(self._detok.step(event.token_id))
            if self.stop_string_hit:
                self.finish_reason = "stop"
        if event.finish_reason is not None and not self.finished:
            self.finish_reason = event.finish_reason
            text += self._stops.flush()
        self.text += text
        delta.text += text
        delta.finish_reason = self.finish_reason
        return delta
