"""GET /docs: Swagger UI over /openapi.json, served from the
swagger-ui-bundle package's files (no CDN: the server may have no network,
and neither may its users' browsers)."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

logger = logging.getLogger(__name__)

ASSETS = "/docs/assets"
DOCS_INIT = f"{ASSETS}/docs-init.js"

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>aioserve API</title>
<link rel="stylesheet" href="{ASSETS}/swagger-ui.css">
<link rel="icon" type="image/png" href="{ASSETS}/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{ASSETS}/swagger-ui-bundle.js"></script>
<script src="{ASSETS}/swagger-ui-standalone-preset.js"></script>
<script src="{DOCS_INIT}"></script>
</body>
</html>
"""

# In a file of its own, not inline: a Content-Security-Policy without
# 'unsafe-inline' still lets the page run.
INIT = """window.ui = SwaggerUIBundle({
  url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset], layout: "StandaloneLayout"
});
"""


async def docs_page(request: Request) -> Response:
    return HTMLResponse(PAGE)


async def docs_init(request: Request) -> Response:
    return Response(INIT, media_type="text/javascript")


def docs_assets() -> list[BaseRoute]:
    """Swagger UI's files (the page and its start-up script are in the route table)."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:  # a dependency, but an install may lack it: the API still serves
        logger.warning("swagger-ui-bundle is not installed; GET /docs will show no UI")
        return []
    return [Mount(ASSETS, app=StaticFiles(directory=swagger_ui_path), name="docs-assets")]
