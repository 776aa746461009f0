"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause becomes one of these with a 4xx status;
anything else is a 500 with the same shape (and a logged traceback).
"""

from __future__ import annotations

import logging
import os.path

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.wire import WireModel, json_response

logger = logging.getLogger(__name__)


class ErrorDetail(WireModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(WireModel):
    error: ErrorDetail


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> Response:
        response = json_response(self.body(), self.status)
        response.headers.update(self.headers)
        return response


def from_validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    param = _common_path([e["loc"] for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]) or None
    message = "; ".join(f"{_field_path(e['loc']) or 'body'}: {_reason(e['msg'])}" for e in errors[:5])
    return APIError(message, param=param)


def _common_path(locs: list[tuple]) -> str:
    """The one field every error of a union names: `[1, "a"]` as a prompt fails
    at prompt.1 as token ids and at prompt.0 as strings; the param is prompt."""
    return ".".join(os.path.commonprefix([_field_path(loc).split(".") for loc in locs]))


def _field_path(loc: tuple) -> str:
    """`messages.0.content`, without the union members pydantic names in
    `loc` ("str", "list[int]", "function-after[...]", a model's class name):
    the client's field is the same whichever member failed. Field names are
    snake_case, so a part with a bracket, a hyphen or a capital is a member."""
    parts = [
        str(part) for part in loc
        if isinstance(part, int) or not (part in _TYPE_NAMES or any(c in part for c in "[-") or part[:1].isupper())
    ]
    return ".".join(parts)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "literal", "tuple", "set"})


def _reason(message: str) -> str:
    """Our own validators' messages read better without pydantic's prefix."""
    return message.removeprefix("Value error, ")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    count_error(request, exc)
    return exc.response()


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    error = APIError(f"internal error: {exc}", status=500, type="internal_server_error")
    count_error(request, error)
    return error.response()


async def client_left_handler(request: Request, exc: Exception) -> Response:
    """The client closed its connection before its body was read whole: not
    a server error (no traceback, not in aioserve:request_errors); the
    status is nginx's 499, which nobody receives."""
    logger.debug("client left during its upload: %s %s", request.method, request.url.path)
    return Response(status_code=499)


def count_error(request: Request, error: APIError) -> None:
    """aioserve:request_errors, by type and status."""
    ctx = getattr(request.app.state, "ctx", None)
    if ctx is not None:
        ctx.metrics.error(error.type, error.status)
