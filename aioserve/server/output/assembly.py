"""The one response path of every generating endpoint.

A handler parses its body, starts a Generation and hands it to `respond`
with a ResponseBuilder: the endpoint's wire shapes and nothing else. From
here on every endpoint is served alike: each choice's text goes through its
ContentProcessor, a stream sends the builder's chunks as server-sent events
(then usage, an error if any, and [DONE]), a whole response waits for every
choice while watching for the client to leave, and whatever still runs when
the client goes away is aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from aioserve.output_stream import OutputDelta
from aioserve.server.errors import APIError
from aioserve.server.output import sse
from aioserve.server.output.completion_bodies import Usage
from aioserve.server.output.content import ContentDelta, ContentProcessor, PlainText
from aioserve.server.output.generation import Choice, Generation
from aioserve.server.output.sliced_json import sliced_json
from aioserve.server.wire import WireModel, json_response

logger = logging.getLogger(__name__)


@dataclass
class ChoiceUpdate:
    """One choice's news, as a builder renders it."""

    choice: Choice
    output: OutputDelta  # tokens, logprobs and text offsets of this update (a whole response: all of them)
    content: ContentDelta  # what the content processor made of this update's text
    message: ContentDelta  # the whole message so far
    finish_reason: str | None  # as the content processor reports it


class ResponseBuilder(Protocol):
    """An endpoint's wire shapes."""

    def opening(self, choices: list[Choice]) -> list[WireModel]:
        """Stream events sent at once, before any token (the Responses API's
        `response.created`); chat's role chunk goes with the first tokens instead."""
        ...

    def chunk(self, updates: list[ChoiceUpdate]) -> list[WireModel]:
        """Stream events for what the choices just produced (possibly none)."""
        ...

    def usage_chunk(self, usage: Usage) -> list[WireModel]:
        """The last stream events, when the client asked for usage."""
        ...

    def whole(self, results: list[ChoiceUpdate], usage: Usage) -> BaseModel:
        """The body of a response that is not streamed."""
        ...


@dataclass
class _ChoiceState:
    processor: ContentProcessor
    message: ContentDelta = field(default_factory=ContentDelta)
    finish_reason: str | None = None


class Assembly:
    """A Generation's deltas, through each choice's content processor."""

    def __init__(self, generation: Generation, new_processor: Callable[[Choice], ContentProcessor]) -> None:
        self.generation = generation
        self._states = {choice: _ChoiceState(new_processor(choice)) for choice in generation.choices}

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        async for deltas in self.generation.deltas():
            yield [self._update(choice, delta) for choice, delta in deltas]

    async def run(self) -> None:
        async for _ in self.updates():
            pass

    def results(self) -> list[ChoiceUpdate]:
        """Each choice's whole output, once all are finished."""
        return [
            ChoiceUpdate(choice, choice.stream.whole(), state.message, state.message, state.finish_reason)
            for choice, state in self._states.items()
        ]

    def _update(self, choice: Choice, delta: OutputDelta) -> ChoiceUpdate:
        state = self._states[choice]
        content = state.processor.feed(delta.text)
        if delta.finish_reason is not None:
            held_back, state.finish_reason = state.processor.finish(delta.finish_reason)
            content.merge(held_back)
        state.message.merge(content)
        return ChoiceUpdate(choice, delta, content, state.message, state.finish_reason)


def plain_text(choice: Choice) -> ContentProcessor:
    return PlainText()


async def respond(
    request: Request,
    generation: Generation,
    builder: ResponseBuilder,
    *,
    stream: bool,
    include_usage: bool = False,
    new_processor: Callable[[Choice], ContentProcessor] = plain_text,
) -> Response:
    assembly = Assembly(generation, new_processor)
    if stream:
        return StreamingResponse(_events(assembly, builder, include_usage), media_type="text/event-stream")
    if not await _finish_unless_client_leaves(request, assembly.run(), generation):
        return Response(status_code=499)  # nobody is listening any more
    error = generation.error()
    if error:
        raise _generation_failed(generation, error)
    results, usage = assembly.results(), generation.usage()
    if sum(_values(result.choice) for result in results) < LARGE_RESPONSE_VALUES:
        return json_response(builder.whole(results, usage))
    # Large: built on a thread of the response pool, and encoded in slices
    # (sliced_json.py) between which the GIL goes back to the loop; the
    # choices are finished, so nothing else touches what the builder reads.
    loop = asyncio.get_running_loop()
    pieces = await loop.run_in_executor(generation.ctx.response_pool, _encoded, builder, results, usage)
    return Response(pieces, media_type="application/json")


# A response that may hold this many values (tokens and their logprob
# entries) is built off the loop: echoed with logprobs, a million entries
# (the budget's default) took the loop 0.35 s to build and 0.7 s to encode on
# 2 cores; n=128 × 60 tokens of chat logprobs, top 20, 4 s. Below, the
# thread's round trip would cost about what the build does.
LARGE_RESPONSE_VALUES = 16384


def _values(choice: Choice) -> int:
    """What a choice's part of the response may hold, at most: its prompt
    (echoed) and output tokens, each with its logprob entries if asked for."""
    params = choice.stream.params
    per_output = 1 if params.logprobs is None else 2 + params.logprobs
    per_prompt = 1 if params.prompt_logprobs is None else 2 + params.prompt_logprobs
    return len(choice.stream.token_ids) * per_output + len(choice.prompt_ids) * per_prompt


def _encoded(builder: ResponseBuilder, results: list[ChoiceUpdate], usage: Usage) -> bytes:
    return b"".join(sliced_json(builder.whole(results, usage)))


def _generation_failed(generation: Generation, error: str) -> APIError:
    """503 when the server itself failed (a rank died or hung: retry
    elsewhere), 500 for a failure of this request alone."""
    if generation.ctx.failure is not None:
        return APIError(error, status=503, type="service_unavailable", code="server_failed")
    return APIError(error, status=500, type="internal_server_error")


async def _events(assembly: Assembly, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body. If the client goes away (the response task is cancelled)
    or anything fails, every unfinished choice is aborted."""
    generation = assembly.generation
    try:
        try:
            for body in builder.opening(generation.choices):
                yield sse.event(body)
            async for updates in assembly.updates():
                for body in builder.chunk(updates):
                    yield sse.event(body)
            if include_usage:
                for body in builder.usage_chunk(generation.usage()):
                    yield sse.event(body)
            error = generation.error()
        except Exception as exc:  # headers are sent: the error can only be an event
            logger.exception("stream %s failed", generation.request_id)
            error = f"internal error: {exc}"
        if error:
            failure = _generation_failed(generation, error)
            generation.ctx.metrics.error(failure.type, failure.status)
            yield sse.event(failure.body())
        yield sse.DONE
    finally:
        generation.close()


async def _finish_unless_client_leaves(
    request: Request, work: Coroutine[Any, Any, None], generation: Generation
) -> bool:
    """Run `work` to the end; False (and everything aborted) if the client
    leaves first."""
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finished = done.done()
    finally:
        gone.cancel()
        if not done.done():  # the client left, or this handler was cancelled
            done.cancel()
            generation.close()
    if not finished:
        # Not done.result(): a task just told to cancel has no result yet.
        logger.info("client left; aborted %s", generation.request_id)
        return False
    done.result()  # what the generation raised, if anything
    return True


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
