"""From a request's scheduler events to what a client sees: text deltas
(incrementally detokenized, cut at stop strings), token ids, logprobs, where
each token's text starts, the finish reason and usage. Shared by the HTTP
handlers and the offline API, which is why ending a request at a stop string
happens here too: both consumers would otherwise have to remember it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aioserve.sampling_params import SamplingParams
from aioserve.scheduler.request import RequestEvent, SpeculativeCounts
from aioserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

TopLogprobs = list[tuple[int, float]]
PromptLogprobs = list[tuple[float, TopLogprobs] | None]


@dataclass
class OutputDelta:
    """What changed since the last delta (or, from `OutputStream.whole`, everything)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    # Where each token's text starts in the stream's whole text. A token that
    # completes nothing yet (the first bytes of a multi-byte character, a
    # skipped special token) starts where the next character will.
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def changed(self) -> bool:
        return bool(self.text or self.token_ids or self.finish_reason)


class OutputStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        end_request: Callable[[], object] | None = None,
    ) -> None:
        """`end_request` is called once when a stop string ends the text: the
        scheduler does not know text, so the consumer must stop the request
        (`scheduler.abort(rid, "stop")`) or it would run to max_tokens."""
        self.prompt_ids = prompt_ids
        self.params = params
        self._end_request = end_request
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._detok_text = ""  # everything detokenized, before stop strings cut it
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs | None] = []
        self.text_offsets: list[int] = []
        self.finish_reason: str | None = None
        self.matched_stop: str | int | None = None  # the stop string, or the token id that stopped it
        self.num_cached_tokens = 0
        self.speculation: SpeculativeCounts | None = None  # with speculative decoding on: its counts so far
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprob_ranks: list[int] = []  # each prompt token's rank, beside prompt_logprobs[1:]
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: RequestEvent, delta: OutputDelta | None = None) -> OutputDelta:
        """Fold one event into the stream and into `delta` (a new one if
        none: pass the last to group several); returns it."""
        delta = delta or OutputDelta()
        self._fold(event, delta)
        return delta

    def fold(self, event: RequestEvent) -> None:
        """Fold one event into the stream only: for a consumer that reads the
        stream's totals, not deltas (the offline API, at every token)."""
        self._fold(event, None)

    def _fold(self, event: RequestEvent, delta: OutputDelta | None) -> None:
        if self.finished:
            return  # tokens computed after a stop string, or a late abort echo
        if event.num_cached_tokens is not None:
            self.num_cached_tokens = event.num_cached_tokens
        if event.speculation is not None:
            self.speculation = event.speculation
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
            self.prompt_logprob_ranks = event.prompt_logprob_ranks or []
        if event.error:
            self.error = event.error
        text = ""
        if event.token_id is not None:
            self._add_token(event.token_id, event, delta)
            # A token that stops the request (EOS, stop_token_ids) is in the
            # token ids but, as in vLLM, its text is not, unless asked for.
            stopped_here = event.finish_reason == "stop" and not self.params.include_stop_str_in_output
            piece = "" if stopped_here else self._detok.step(event.token_id)
            self._detok_text += piece
            # As in vLLM, min_tokens holds back stop strings as it holds back EOS and stop ids.
            text, stop_string_hit = self._stops.feed(piece, active=len(self.token_ids) >= self.params.min_tokens)
            if stop_string_hit:
                self.finish_reason = "stop"
                self.matched_stop = self._stops.matched
                if self._end_request is not None:
                    self._end_request()
        if event.finish_reason is not None and not self.finished:
            self.finish_reason = event.finish_reason
            if event.finish_reason == "stop" and event.token_id is not None:
                self.matched_stop = event.token_id  # EOS or a stop token id
            text += self._stops.flush()
        self.text += text
        if delta is not None:
            delta.text += text
            delta.finish_reason = self.finish_reason

    def end(self, reason: str) -> None:
        """Finished without a final event (its reader left): for bookkeeping."""
        if not self.finished:
            self.finish_reason = reason

    def whole(self) -> OutputDelta:
        """Everything so far, as one delta."""
        return OutputDelta(
            self.text, self.token_ids, self.logprobs, self.top_logprobs, self.text_offsets, self.finish_reason
        )

    def _add_token(self, token_id: int, event: RequestEvent, delta: OutputDelta | None) -> None:
        assert event.logprob is not None  # a token's event carries its logprob (OutputProcessor._event)
        offset = len(self._detok_text)
        for stream in (self, delta) if delta is not None else (self,):
            stream.token_ids.append(token_id)
            stream.logprobs.append(event.logprob)
            stream.top_logprobs.append(event.top_logprobs)
            stream.text_offsets.append(offset)

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended
        the output; None when it ended otherwise (EOS, length, abort)."""
        if self.finish_reason != "stop" or self.matched_stop is None:
            return None
        if isinstance(self.matched_stop, int) and self.matched_stop not in self.params.stop_token_ids:
            return None  # the model's EOS
        return self.matched_stop
