"""Answers a body whose Content-Length is over --max-request-bytes with 413
at once, before any handler (or the API-key check) runs and before any of
the body is read. The upload is then read on and dropped (up to
request_body.DISCARD_LIMIT, each read within --request-body-timeout), so
that a client still sending reads the 413 instead of a broken pipe, and the
connection is closed. (With `Expect: 100-continue`, hypercorn itself sends
the 100 before the application sees the request; the 413 follows at once.)"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aioserve.server.context import ServingContext
from aioserve.server.intake.request_body import DISCARD_LIMIT, too_large

logger = logging.getLogger(__name__)


class UploadGuard:
    def __init__(self, app: ASGIApp, ctx: ServingContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.ctx.args.max_request_bytes
        if scope["type"] != "http" or _declared_length(scope) <= limit:
            await self.app(scope, receive, send)
            return
        error = too_large(limit)
        self.ctx.metrics.error(error.type, error.status)
        await error.response()(scope, receive, send)
        await _drain(receive, self.ctx.args.request_body_timeout)


def _declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


async def _drain(receive: Receive, timeout: float | None) -> None:
    read = 0
    while read <= DISCARD_LIMIT:
        try:
            message: Message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
