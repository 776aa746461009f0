"""Server-sent events as OpenAI (and SGLang) clients read them."""

from __future__ import annotations

from aioserve.server.wire import WireModel

DONE = b"data: [DONE]\n\n"


def event(body: WireModel) -> bytes:
    return b"data: " + body.json_bytes() + b"\n\n"
