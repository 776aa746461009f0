"""Running pooling requests for a handler: one scheduler request per
input, submitted together (all checked before any is queued), their
vectors awaited together; a client that leaves or a failure aborts them
all, so every page and slot comes back."""

from __future__ import annotations

import asyncio
import itertools

from aioserve.sampling_params import SamplingParams
from aioserve.scheduler.pooling import PooledOutput, PoolingState
from aioserve.scheduler.request import Request, RequestEvent, RequestRejected
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError

_ids = itertools.count()


async def pool_prompts(ctx: ServingContext, prompts: list[list[int]], score: bool, param: str) -> list[PooledOutput]:
    """Each prompt's pooled output, in order. A prompt the scheduler
    refuses (empty, too long, ids out of the vocabulary) is a 400 naming `param`."""
    pooler = ctx.pooler
    assert pooler is not None
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[PooledOutput]] = [loop.create_future() for _ in prompts]
    requests = [
        Request(f"pool-{next(_ids)}", ids, SamplingParams(max_tokens=0), sink=_sink(future),
                pooling=PoolingState(pooler.pooling_type, score, ctx.score_row, causal=ctx.pooling_causal))
        for ids, future in zip(prompts, futures)
    ]
    try:
        ctx.scheduler.submit_all(requests)
    except RequestRejected as exc:
        raise APIError(str(exc), param=param) from None
    try:
        return list(await asyncio.gather(*futures))
    finally:
        for request in requests:
            if not request.finished:
                ctx.scheduler.abort(request.rid)


def _sink(future: asyncio.Future[PooledOutput]):
    def on_event(event: RequestEvent) -> None:
        if future.done():
            return
        if event.pooled is not None:
            future.set_result(event.pooled)
        elif event.finish_reason is not None:
            why = event.error or f"the request ended ({event.finish_reason}) before its prompt was computed"
            future.set_exception(APIError(why, status=500 if event.finish_reason == "error" else 503,
                                          type="server_error" if event.finish_reason == "error" else "service_unavailable"))

    return on_event
