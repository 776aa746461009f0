"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause becomes one of these with a 4xx status;
anything else is a 500 with the same shape (and a logged traceback).
"""

from __future__ import annotations

import logging

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.responses import ErrorDetail, ErrorResponse
from aioserve.server.wire import json_response

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> Response:
        return json_response(self.body(), self.status)


def from_validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    param = ".".join(str(part) for part in errors[0]["loc"]) or None
    message = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {_reason(e['msg'])}" for e in errors[:5])
    return APIError(message, param=param)


def _reason(message: str) -> str:
    """Our own validators' messages read better without pydantic's prefix."""
    return message.removeprefix("Value error, ")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    return APIError(f"internal error: {exc}", status=500, type="internal_server_error").response()
