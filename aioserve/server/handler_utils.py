"""Pieces every generating handler shares: body parsing, waiting for a
result while watching for the client to leave, and the SSE wrapper."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from aioserve.server.errors import APIError, from_validation_error
from aioserve.server.generation import Generation
from aioserve.server.sse import DONE, event

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, model: type[Body]) -> Body:
    try:
        raw = await request.body()
        data = json.loads(raw)
    except ClientDisconnect:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_completion(request: Request, generation: Generation) -> bool:
    """Wait until every choice is finished; False (and everything aborted) if
    the client leaves first."""
    done = asyncio.ensure_future(generation.wait())
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()
            generation.close()
            logger.info("client left; aborted %s", generation.request_id)
    if done.cancelled():
        return False
    done.result()
    error = generation.error()
    if error:
        raise APIError(error, status=500, type="internal_server_error")
    return True


async def stream_events(generation: Generation, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """SSE body: the handler's chunks, then [DONE]. If the client goes away
    (the task is cancelled) or anything fails, every unfinished choice is aborted."""
    try:
        async for chunk in chunks:
            yield chunk
        error = generation.error()
        if error:
            yield event(APIError(error, status=500, type="internal_server_error").body())
        yield DONE
    finally:
        generation.close()
