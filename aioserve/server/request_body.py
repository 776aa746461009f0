"""Reading a JSON body into a pydantic request model, with every way it can
fail answered as an OpenAI-style error: 413 for a body over
--max-request-bytes (before it is read whole), 400 for anything else."""

from __future__ import annotations

import json
import logging
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from aioserve.server.errors import APIError, from_validation_error

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)

# (model, field) pairs already logged: clients send vendor extras on every
# request, and one line per field is enough to notice them.
_logged_unknown: set[tuple[str, str]] = set()


async def parse_body(request: Request, model: type[Body]) -> Body:
    raw = await read_body(request, request.app.state.ctx.args.max_request_bytes)
    _check_content_type(request)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    if _ESCAPED_SURROGATE.search(raw):
        _check_surrogates(data, [])
    _log_unknown_fields(model, data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# An over-long body is read on and dropped, up to this much, before the 413 is
# sent: a client still uploading when the answer comes sees a broken pipe
# instead of the 413 (httpx, requests). Past it the connection is just closed.
DISCARD_LIMIT = 64 << 20


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over `limit`
    (from Content-Length, else while it streams in) and never held whole."""
    declared = request.headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # ClientDisconnect passes up: nobody to answer
        size += len(chunk)
        over = over or size > limit
        if over:
            chunks.clear()
            if size > DISCARD_LIMIT:
                break
        else:
            chunks.append(chunk)
    if over:
        raise _too_large(limit)
    return b"".join(chunks)


# JSON may spell half of a UTF-16 pair alone ("\\ud800"); Python keeps it in
# the string, and the tokenizer then fails on it. Only bodies that contain
# such an escape (or, since json.loads decodes bytes with surrogatepass, one
# encoded raw) are walked.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def _check_surrogates(value: object, path: list[str]) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("text must be valid Unicode: it holds a lone surrogate", param=".".join(path) or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_surrogates(key, path)
            _check_surrogates(item, [*path, str(key)])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_surrogates(item, [*path, str(index)])


def _too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)",
        status=413,
        code="request_too_large",
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


def _log_unknown_fields(model: type[BaseModel], data: dict) -> None:
    known = set(model.model_fields) | {
        f.alias for f in model.model_fields.values() if f.alias
    }
    for name in data.keys() - known:
        if (model.__name__, name) not in _logged_unknown and len(_logged_unknown) < 1000:
            _logged_unknown.add((model.__name__, name))
            logger.warning("ignoring field %r, unknown to %s (logged once)", name[:100], model.__name__)
