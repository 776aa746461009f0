"""The starlette app: routes, error handlers, CORS and the API-key check."""

from __future__ import annotations

import logging
import os
import secrets

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aioserve.server.context import RETRY_AFTER_S, ServingContext
from aioserve.server.endpoints.metrics import register_scheduler_metrics
from aioserve.server.endpoints.page import page_routes
from aioserve.server.endpoints.routes import ENDPOINTS
from aioserve.server.errors import APIError, api_error_handler, client_left_handler, unexpected_error_handler
from aioserve.server.intake.lingering_close import LingeringClose
from aioserve.server.intake.upload_guard import UploadGuard
from aioserve.server.openapi.docs_routes import docs_assets
from aioserve.server.request_metrics import stamp_arrival

logger = logging.getLogger(__name__)


# Open even with --api-key: probes and scrapers (the route table's open
# endpoints: /health, /metrics), and the chat page with its files (it asks
# the user for the key before any call).
OPEN_PATHS = (*(endpoint.path for endpoint in ENDPOINTS if endpoint.open), "/")
OPEN_PREFIXES = ("/static/", "/docs/assets/")


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class APIKeyCheck:
    """With --api-key (or AIOSERVE_API_KEY), every route but the open ones
    wants `Authorization: Bearer <key>`, compared in constant time: /v1/*,
    /generate, /tokenize, /flush_cache, /server_info alike.
    Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass through.
    A CORS preflight passes unchecked: browsers never send credentials on one,
    and answering it 401 would keep a page from ever sending its key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _is_open(scope["path"]) and not _is_preflight(scope):
            # The scheme is case-insensitive (RFC 9110): "bearer KEY" is accepted too.
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (secrets.compare_digest(given.strip(), self.expected) and scheme.lower() == b"bearer"):
                response = APIError("invalid or missing API key", status=401, code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServingGate:
    """Outermost: stamps each request's arrival (for time to first token) and,
    while the server drains after SIGTERM, answers 503 to everything but the
    open routes (/health itself says 503) so that a load balancer moves on."""

    def __init__(self, app: ASGIApp, ctx: ServingContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            stamp_arrival(scope)
            if self.ctx.draining and not _is_open(scope["path"]):
                error = APIError(
                    "the server is shutting down", status=503, type="service_unavailable", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
                self.ctx.metrics.error(error.type, error.status)
                await error.response()(scope, receive, send)
                return
            try:
                await self.app(scope, receive, send)
            finally:  # a request that failed before it was submitted gives back its reservation
                self.ctx.admitted(scope)
            return
        await self.app(scope, receive, send)


def _is_preflight(scope: Scope) -> bool:
    headers = scope["headers"]
    return scope["method"] == "OPTIONS" and any(name == b"access-control-request-method" for name, _ in headers)


def parse_origins(allowed: str | None) -> list[str]:
    """--allowed-origins: "a, b" -> ["a", "b"]; "*" -> ["*"]; unset or blank -> [] (no CORS)."""
    return [origin.strip().rstrip("/") for origin in (allowed or "").split(",") if origin.strip()]


def build_middleware(
    allowed_origins: str | None, api_key: str | None, ctx: ServingContext | None = None
) -> list[Middleware]:
    """Outermost first. The lingering close wraps everything that may answer
    before a body is read; CORS wraps the key check so that its headers are
    on a 401 too (else the page sees an opaque network error, not "bad key")."""
    middleware = [Middleware(LingeringClose)]
    if ctx is not None:
        middleware += [Middleware(ServingGate, ctx=ctx), Middleware(UploadGuard, ctx=ctx)]
    origins = parse_origins(allowed_origins)
    if origins:
        logger.info("CORS allowed for %s", ", ".join(origins))
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["authorization", "content-type"],
                max_age=600,
            )
        )
    if api_key:
        middleware.append(Middleware(APIKeyCheck, api_key=api_key))
    return middleware


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Unknown routes and wrong methods, in the same error shape."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(  # a 405's Allow header (RFC 9110) comes with the exception
        f"{exc.detail}: {request.method} {request.url.path}", status=exc.status_code, type=kind,
        headers=dict(exc.headers or {}),
    ).response()


def create_app(ctx: ServingContext) -> Starlette:
    register_scheduler_metrics(ctx)
    routes = [
        *(Route(endpoint.path, endpoint.handler, methods=[endpoint.method]) for endpoint in ENDPOINTS),
        *docs_assets(),
        *page_routes(),
    ]
    app = Starlette(
        routes=routes,
        middleware=build_middleware(
            ctx.args.allowed_origins, ctx.args.api_key or os.environ.get("AIOSERVE_API_KEY"), ctx
        ),
        exception_handlers={
            APIError: api_error_handler,
            ClientDisconnect: client_left_handler,
            HTTPException: http_error_handler,
            Exception: unexpected_error_handler,
        },
    )
    app.state.ctx = ctx
    return app
