"""Answers a body whose Content-Length is over --max-request-bytes with 413
at once, before any handler (or the API-key check) runs and before any of
the body is read. What the client still sends is read on and dropped for a
bounded time before the connection closes (lingering_close.py), so that a
client still uploading reads the 413 instead of a broken pipe. (With
`Expect: 100-continue`, hypercorn itself sends the 100 before the
application sees the request; the 413 follows at once.)"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from aioserve.server.context import ServingContext
from aioserve.server.intake.request_body import too_large

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


def _declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
