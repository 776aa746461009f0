"""One HTTP endpoint as plain data: where it is, what answers it, and how
the OpenAPI document describes it. endpoints/routes.py lists them; the app
and the document both read that one list, so a route cannot be served
undocumented."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Endpoint:
    path: str  # starlette's form: "/v1/models/{model:path}"
    method: str  # "GET" or "POST"
    handler: Handler
    operation: dict[str, Any]  # the OpenAPI operation object (summary, operationId, responses...)
    open: bool = False  # answered without the API key: probes and scrapers

    @property
    def openapi_path(self) -> str:
        """The path as OpenAPI writes it: "{model:path}" becomes "{model}"."""
        return self.path.replace(":path}", "}")
