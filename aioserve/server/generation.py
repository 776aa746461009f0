"""The bridge between an HTTP handler and the scheduler.

A Generation submits one scheduler request per choice (n per prompt), each
pushing its events into one queue, and turns them into per-choice deltas,
grouping whatever arrived since the last look into one delta per choice.
It ends requests whose text hit a stop string, and `close()` aborts what is
still running when the client goes away.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from aioserve.output_stream import OutputDelta, OutputStream
from aioserve.sampling_params import SamplingParams, SamplingParamsError
from aioserve.scheduler import Request, RequestEvent, RequestRejected
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError

_counter = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass(eq=False)
class Choice:
    index: int
    prompt_index: int
    rid: str
    prompt_ids: list[int]
    stream: OutputStream


class Generation:
    def __init__(self, ctx: ServingContext, request_id: str) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.choices: list[Choice] = []
        self._queue: asyncio.Queue[tuple[Choice, RequestEvent]] = asyncio.Queue()

    def validate(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        """Refuse now (400) what the scheduler could never serve."""
        try:
            params.validate(self.ctx.vocab_size)
            self.ctx.scheduler.validate(len(prompt_ids), params.max_tokens)
        except (SamplingParamsError, RequestRejected) as exc:
            raise APIError(str(exc), param=exc.param) from None
        if any(not 0 <= t < self.ctx.vocab_size for t in prompt_ids):
            raise APIError(f"prompt token ids must be in [0, {self.ctx.vocab_size})", param="prompt")

    def add(self, index: int, prompt_index: int, prompt_ids: list[int], params: SamplingParams) -> Choice:
        rid = f"{self.request_id}-{index}-{next(_counter)}"
        choice = Choice(index, prompt_index, rid, prompt_ids, OutputStream(self.ctx.tokenizer, prompt_ids, params))
        queue = self._queue
        request = Request(rid, prompt_ids, params, sink=lambda event: queue.put_nowait((choice, event)))
        try:
            self.ctx.scheduler.submit(request)
        except RequestRejected as exc:
            self.close()
            raise APIError(str(exc), param=exc.param) from None
        self.choices.append(choice)
        return choice

    @property
    def finished(self) -> bool:
        return all(c.stream.finished for c in self.choices)

    async def deltas(self) -> AsyncIterator[list[tuple[Choice, OutputDelta]]]:
        """Yield, until every choice is finished, the deltas of the choices
        that changed: everything queued since the last yield, one per choice."""
        while not self.finished:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            grouped: dict[Choice, OutputDelta] = {}
            for choice, event in items:
                was_finished = choice.stream.finished
                grouped[choice] = choice.stream.add(event, grouped.get(choice))
                if choice.stream.stop_string_hit and not was_finished:
                    self.ctx.scheduler.abort(choice.rid, "stop")
            yield [(c, d) for c, d in grouped.items() if d.text or d.token_ids or d.finish_reason]

    async def wait(self) -> None:
        async for _ in self.deltas():
            pass

    def close(self) -> None:
        """Abort whatever still runs (the client left, or an error)."""
        for choice in self.choices:
            if not choice.stream.finished:
                self.ctx.scheduler.abort(choice.rid)

    def usage(self) -> dict:
        prompts = {c.prompt_index: c for c in self.choices}
        prompt_tokens = sum(len(c.prompt_ids) for c in prompts.values())
        completion_tokens = sum(len(c.stream.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.stream.num_cached_tokens for c in prompts.values())},
        }

    def error(self) -> str | None:
        return next((c.stream.error or "generation failed" for c in self.choices if c.stream.finish_reason == "error"), None)


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The n choices of one prompt must differ: each gets its own seed."""
    if choice == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + choice)
