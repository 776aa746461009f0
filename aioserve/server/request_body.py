"""Reading a JSON body into a pydantic request model, with every way it can
fail answered as an OpenAI-style 400."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from aioserve.server.errors import APIError, from_validation_error

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
