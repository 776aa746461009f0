"""The bridge between an HTTP handler and the scheduler.

A Generation submits one scheduler request per choice (n per prompt), each
pushing its events into one queue, and turns them into per-choice deltas,
grouping whatever arrived since the last look into one delta per choice.
`close()` aborts what is still running when the client goes away.

A handler that answers with the whole output (not a stream) is woken when
a choice finishes or has HELD_EVENTS events waiting, not once per step: on
2 cores the event loop's CPU time is taken from the forward's (tiny-llama,
16 concurrent: a task wake-up per request per step was about a third of
the loop's time). The bound keeps a long generation's waiting events few.
A choice with stop strings is still read every step: a string found ends
its request early.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from aioserve.image_inputs import PromptImages
from aioserve.output_stream import OutputDelta, OutputStream
from aioserve.sampling_params import SamplingParams, SamplingParamsError
from aioserve.scheduler import Request, RequestEvent, RequestRejected
from aioserve.scheduler.adapters import Adapter
from aioserve.scheduler.constraint import ConstraintFactory
from aioserve.scheduler.request import EventSink
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.image_parts import check_image_tokens
from aioserve.server.output.completion_bodies import PromptTokensDetails, Usage

_counter = itertools.count()
# Seeded once from the OS; uuid4 asked the OS for fresh bytes per id, which
# took ~0.1 ms a request in a VM (a syscall), on the event loop's thread.
_id_bits = random.Random()


# Events a whole response's choice may hold back before its handler reads them.
HELD_EVENTS = 64


def new_id(prefix: str) -> str:
    return f"{prefix}-{_id_bits.getrandbits(96):024x}"


@dataclass(eq=False)
class Choice:
    index: int  # prompt-major: prompt_index * n + the prompt's choice number
    prompt_index: int
    rid: str
    prompt_ids: list[int]
    stream: OutputStream
    request: Request  # the scheduler's, read for its admission time
    last_token_at: float | None = None


class Generation:
    def __init__(
        self, ctx: ServingContext, request_id: str, arrival: float | None = None, incremental: bool = True
    ) -> None:
        """`arrival`: when the HTTP request came in (time.monotonic), so that
        time to first token counts reading and tokenizing it too.
        `incremental`: the consumer reads deltas as they come (a stream);
        otherwise only the whole output (see the module's docstring)."""
        self.ctx = ctx
        self.request_id = request_id
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.incremental = incremental
        self.choices: list[Choice] = []
        # (choice, event, when the scheduler emitted it)
        self._queue: asyncio.Queue[tuple[Choice, RequestEvent, float]] = asyncio.Queue()

    def start(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1, grammar: ConstraintFactory | None = None,
        adapters: Sequence[Adapter | None] | Adapter | None = None,
        images: Sequence[PromptImages | None] | None = None,
    ) -> None:
        """n choices for each prompt, submitted together: the scheduler checks
        them all before it queues any, so that a 400 leaves nothing behind.
        `grammar` (compiled from params.structured_outputs) gives each choice its own matcher.
        `adapters`: the LoRA adapter of every prompt, or one per prompt (None: the base model).
        `images`: a vision-language model's images of each prompt (None: none),
        its placeholders already expanded in the prompt's ids
        (server/intake/image_parts.py); a prompt's choices share them."""
        per_prompt = list(adapters) if isinstance(adapters, Sequence) else [adapters] * len(prompts)
        prompt_images = list(images) if images is not None else [None] * len(prompts)
        if len(prompt_images) != len(prompts):
            raise ValueError(f"{len(prompt_images)} image lists for {len(prompts)} prompts")
        for prompt_ids, its_images in zip(prompts, prompt_images):
            check_image_tokens(self.ctx, prompt_ids, its_images)
        choices = [
            self._choice(p * n + j, p, prompt_ids, _choice_params(params, j), grammar)
            for p, prompt_ids in enumerate(prompts)
            for j in range(n)
        ]
        for choice in choices:
            choice.request.adapter = per_prompt[choice.prompt_index]
            choice.request.images = prompt_images[choice.prompt_index]
        try:
            self.ctx.scheduler.submit_all([choice.request for choice in choices])
        except (SamplingParamsError, RequestRejected) as exc:
            raise APIError(str(exc), param=exc.param) from None
        self.choices = choices
        self.ctx.generations.add(self)

    def _choice(
        self, index: int, prompt_index: int, prompt_ids: list[int], params: SamplingParams,
        grammar: ConstraintFactory | None,
    ) -> Choice:
        rid = f"{self.request_id}-{index}-{next(_counter)}"
        end_request = partial(self.ctx.scheduler.abort, rid, "stop")
        stream = OutputStream(self.ctx.tokenizer, prompt_ids, params, end_request=end_request)
        request = Request(rid, prompt_ids, params, sink=self._sink(lambda: choice, params), grammar=grammar)
        choice = Choice(index, prompt_index, rid, prompt_ids, stream, request)
        return choice

    def _sink(self, choice: Callable[[], Choice], params: SamplingParams) -> EventSink:
        """Where a choice's scheduler request puts its events: the queue at
        once, or (whole output, no stop strings) a list handed to the queue
        when the request finishes or the list reaches HELD_EVENTS. Each event
        is stamped with its time, for the latency metrics."""
        queue = self._queue
        if self.incremental or params.stop:
            return lambda event: queue.put_nowait((choice(), event, time.monotonic()))
        held: list[tuple[Choice, RequestEvent, float]] = []

        def hold_back(event: RequestEvent) -> None:
            held.append((choice(), event, time.monotonic()))
            if event.finish_reason is not None or len(held) >= HELD_EVENTS:
                for item in held:
                    queue.put_nowait(item)
                held.clear()

        return hold_back

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
            for choice, event, emitted in items:
                self._observe(choice, event, emitted)
                grouped[choice] = choice.stream.add(event, grouped.get(choice))
            yield [(c, d) for c, d in grouped.items() if d.changed]
        self.ctx.generations.discard(self)

    def _observe(self, choice: Choice, event: RequestEvent, now: float) -> None:
        """Latency metrics, at the time the scheduler emitted the event."""
        metrics = self.ctx.metrics
        if event.token_id is not None:
            if choice.last_token_at is None:
                metrics.time_to_first_token.observe(now - self.arrival)
                if choice.request.admitted_at is not None:
                    metrics.request_queue_time.observe(choice.request.admitted_at - choice.request.arrival)
            else:
                metrics.inter_token_latency.observe(now - choice.last_token_at)
            choice.last_token_at = now
        if event.finish_reason is not None and not choice.stream.finished:
            metrics.finished(event.finish_reason)
            metrics.e2e_request_latency.observe(now - self.arrival)

    def fail(self, reason: str) -> None:
        """End every unfinished choice with an error event (the server failed:
        a rank died or hung), so its handler answers with a clean error."""
        now = time.monotonic()
        for choice in self.choices:
            if not choice.stream.finished:
                self._queue.put_nowait((choice, RequestEvent(finish_reason="error", error=reason), now))

    def abort(self) -> None:
        """Abort whatever still runs; its final (abort) events still come to
        `deltas()`, for a handler that is reading them (the drain's timeout)."""
        for choice in self.choices:
            if not choice.stream.finished:
                self.ctx.scheduler.abort(choice.rid)

    def close(self) -> None:
        """Abort whatever still runs and mark it finished now: nobody reads
        this generation any more (the client left, or an error), so the abort
        events the scheduler sends back would never be folded in, and the
        drain on shutdown must not wait for them."""
        self.abort()
        for choice in self.choices:
            choice.stream.end("abort")
        self.ctx.generations.discard(self)

    def usage(self) -> Usage:
        """Each prompt counts once, however many choices it has."""
        prompts = {c.prompt_index: c for c in self.choices}
        prompt_tokens = sum(len(c.prompt_ids) for c in prompts.values())
        completion_tokens = sum(len(c.stream.token_ids) for c in self.choices)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(c.stream.num_cached_tokens for c in prompts.values())
            ),
        )

    def error(self) -> str | None:
        return next((c.stream.error or "generation failed" for c in self.choices if c.stream.finish_reason == "error"), None)


def _choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The n choices of one prompt must differ: each gets its own seed."""
    if choice == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + choice)
