"""Whatever answers a request before its body has all arrived (read_body's
413 or 408, UploadGuard's 413, the API-key check's 401, a 405, any handler
that answers without reading) is followed by a lingering close: the answer
goes out whole, the rest of the body is read on and dropped for a bounded
time, then the response ends and hypercorn closes the connection (or keeps
it, if the body did end meanwhile).

Why here, as plain ASGI around everything: hypercorn hands the body to the
application through a queue of 10 chunks. A handler that stops reading
while the client keeps sending fills it, and hypercorn, on the response's
end, puts "disconnect" into that full queue from the application's own
task: the task waits on itself, the close that `Connection: close` promised
never comes, and the connection and its task stay for good. Draining while
the response ends keeps the queue moving; lingering first lets a client
still uploading (httpx, requests) finish and read the answer instead of a
reset that would discard it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

# The linger's bounds: a client still sending after the answer is read from
# for at most LINGER_S, LINGER_IDLE_S once it pauses, and DISCARD_LIMIT
# bytes, then closed. Enough for an upload in flight to finish on a LAN; a
# hostile one that never stops sending is cut off within seconds.
LINGER_S = 2.0
LINGER_IDLE_S = 0.5
DISCARD_LIMIT = 64 << 20


@dataclass
class _Body:
    """Where one request's body stands, from the application's side."""

    ended: bool  # its last chunk (or a disconnect) has been received
    answered: bool = False  # the response has ended: nothing more will be received


class LingeringClose:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _Body(ended=not _has_body(scope))

        async def tracked_receive() -> Message:
            if body.answered:  # what hypercorn would say once the response is over
                return {"type": "http.disconnect"}
            message = await receive()
            body.ended = body.ended or _ends_body(message)
            return message

        async def guarded_send(message: Message) -> None:
            if body.ended or message["type"] != "http.response.body" or message.get("more_body", False):
                await send(message)
                return
            await send({**message, "more_body": True})  # the whole answer first
            await _linger_then_end(receive, send, body)

        await self.app(scope, tracked_receive, guarded_send)


async def _linger_then_end(receive: Receive, send: Send, body: _Body) -> None:
    """Read the body on and drop it until it ends, the client pauses, or the
    linger's bounds pass; then end the response, still draining (the queue
    must have room for hypercorn's disconnect)."""
    enough = asyncio.Event()

    async def drain() -> None:
        read = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), None if enough.is_set() else LINGER_IDLE_S)
            except asyncio.TimeoutError:  # the client paused: it has sent what it will
                enough.set()
                continue
            if _ends_body(message):
                body.ended = True
                enough.set()
                return
            read += len(message.get("body", b""))
            if read > DISCARD_LIMIT:
                enough.set()

    drainer = asyncio.create_task(drain())
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(enough.wait(), LINGER_S)
        if not body.ended:
            logger.debug("closing a connection whose client is still sending after its answer")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        body.answered = True
        drainer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drainer


def _ends_body(message: Message) -> bool:
    return message["type"] != "http.request" or not message.get("more_body", False)


def _has_body(scope: Scope) -> bool:
    """Whether the request announces a body (else hypercorn has none to give,
    and nothing need be read before the connection is reused)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False
