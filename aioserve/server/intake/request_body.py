"""Reading a JSON body into a pydantic request model, with every way it can
fail answered as an OpenAI-style error: 413 for a body over
--max-request-bytes (before it is read whole), 400 for anything else."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from aioserve.server.body.checks import BodyRejected, decode
from aioserve.server.body.parser_process import BODY_WORKER_BYTES
from aioserve.server.errors import APIError, from_validation_error

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)

# (model, field) pairs already logged: clients send vendor extras on every
# request, and one line per field is enough to notice them.
_logged_unknown: set[tuple[str, str]] = set()


async def parse_body(request: Request, model: type[Body]) -> Body:
    """Read, check the per-request bounds (server/body/checks.py), validate.
    A large body is parsed and checked by the worker process, off the loop."""
    ctx = request.app.state.ctx
    raw = await read_body(
        request, ctx.args.max_request_bytes, ctx.args.request_body_timeout, ctx.args.request_body_deadline
    )
    _check_content_type(request)
    known = _known_fields(model)
    try:
        if len(raw) >= BODY_WORKER_BYTES:
            data, unknown = await ctx.body_parser.decode(raw, ctx.request_limits, known)
        else:
            data, unknown = decode(raw, ctx.request_limits, known)
    except BodyRejected as exc:
        raise APIError(exc.message, param=exc.param, code=exc.code) from None
    _log_unknown_fields(model, unknown)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def read_body(
    request: Request, limit: int, timeout: float | None = None, deadline: float | None = None
) -> bytes:
    """The body, refused with 413 as soon as it is known to be over `limit`
    (from Content-Length, else while it streams in) and never held whole
    (what is still coming is read on and dropped by lingering_close.py);
    with 408 when the client sends nothing for `timeout` seconds, or the
    whole body takes longer than `deadline` (a stalled upload, or one
    trickling a byte a second, would hold its connection, and a file
    descriptor, forever). ClientDisconnect passes up (endpoints/app.py
    answers it quietly: nobody to answer)."""
    declared = request.headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    ends = time.monotonic() + deadline if deadline is not None else None
    while True:
        wait, by_deadline = timeout, False
        if ends is not None:
            left = ends - time.monotonic()
            if left <= 0:
                raise body_deadline(deadline) from None
            if wait is None or left < wait:
                wait, by_deadline = left, True
        try:
            chunk = await asyncio.wait_for(anext(stream), wait)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            # Which bound this wait was (a timer may fire a hair before the clock reads the deadline).
            raise (body_deadline(deadline) if by_deadline else body_timeout(timeout)) from None
        size += len(chunk)
        if over or size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    if over:
        raise too_large(limit)
    return b"".join(chunks)


def body_timeout(timeout: float | None) -> APIError:
    return APIError(
        f"the request body stalled: nothing arrived for {timeout:g} s (--request-body-timeout)",
        status=408, code="request_timeout", headers={"Connection": "close"},
    )


def body_deadline(deadline: float | None) -> APIError:
    return APIError(
        f"the request body took longer than {deadline:g} s to arrive (--request-body-deadline)",
        status=408, code="request_timeout", headers={"Connection": "close"},
    )


def too_large(limit: int) -> APIError:
    """413; the connection is closed after it (a client may still be sending)."""
    return APIError(
        f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)",
        status=413,
        code="request_too_large",
        headers={"Connection": "close"},
    )


def _check_content_type(request: Request) -> None:
    """JSON, or no Content-Type at all (as FastAPI-based servers accept);
    a form post (curl -d without -H) is a mistake worth naming."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media = content_type.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(f"Content-Type must be application/json, not {media or 'empty'!r}")


def _known_fields(model: type[BaseModel]) -> frozenset[str]:
    """Its fields, and the ones it refuses by name (RequestModel.unhonoured)."""
    refused = getattr(model, "unhonoured", {})
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias} | set(refused)


def _log_unknown_fields(model: type[BaseModel], unknown: list[str]) -> None:
    for name in unknown:
        if (model.__name__, name) not in _logged_unknown and len(_logged_unknown) < 1000:
            _logged_unknown.add((model.__name__, name))
            logger.warning("ignoring field %r, unknown to %s (logged once)", name[:100], model.__name__)
