"""GET /: the chat page, /static/ for its script and style sheet, and
GET /page-config for what the page must know before the first prompt.

The page is plain files under static/ (no build step, nothing fetched from
elsewhere). Its script and styles are separate files rather than inline so
the page can be sent with a Content-Security-Policy that forbids inline
script: even if model text ever reached the DOM as markup, nothing in it
would run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"

# 'self' only: the page talks to the server that served it and loads nothing
# else. Other sites that want the API use --allowed-origins (CORS) instead.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

# Browsers keep no stale copy across a server upgrade.
_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"}


async def chat_page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)


async def page_config(request: Request) -> Response:
    """Whether the model has a chat template (the page picks chat or plain
    completion up front instead of learning it from a refused chat request)
    and takes images (the page offers to attach them). Behind the API key,
    like the API."""
    ctx = request.app.state.ctx
    return JSONResponse({
        "model": ctx.model_name, "chat_template": ctx.tokenizer.has_chat_template, "images": ctx.images is not None,
    })


class _StaticFiles(StaticFiles):
    """StaticFiles with the page's headers on every file."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(_HEADERS)
        return response


def page_routes() -> list[BaseRoute]:
    if not (STATIC_DIR / "index.html").is_file():
        # An install that lost the package data: serve the API without the page.
        logger.warning("chat page files missing under %s; GET / will answer 404", STATIC_DIR)
        return []
    return [
        Route("/", chat_page, methods=["GET"]),
        Route("/page-config", page_config, methods=["GET"]),
        Mount("/static", app=_StaticFiles(directory=STATIC_DIR), name="static"),
    ]
