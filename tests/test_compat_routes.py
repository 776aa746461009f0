"""Routes vLLM and SGLang users call: GET /version, GET /get_model_info (both
served by worker_routes.py) and GET /docs (Swagger UI from the
swagger-ui-bundle package's files, no CDN)."""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import httpx


def get(server: Any, path: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", headers=headers, timeout=30)


def test_version(stories_server: Any) -> None:
    response = get(stories_server, "/version")
    assert response.status_code == 200
    assert response.json() == {"version": importlib.metadata.version("aioserve")}


def test_get_model_info(stories_server: Any, stories_path: Any) -> None:
    info = get(stories_server, "/get_model_info").json()
    assert info["model_path"] == str(stories_path) and info["tokenizer_path"] == str(stories_path)
    assert info["is_generation"] is True
    assert info["max_context_length"] == stories_server.info()["max_model_len"]


def test_docs_serves_swagger_ui_from_local_assets(stories_server: Any) -> None:
    page = get(stories_server, "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/docs/assets/") for a in assets)  # nothing from a CDN
    for asset in assets:
        response = get(stories_server, asset)
        assert response.status_code == 200 and response.content, asset
    init = get(stories_server, "/docs/assets/docs-init.js").text
    assert '"/openapi.json"' in init
    bundle = get(stories_server, "/docs/assets/swagger-ui-bundle.js")
    assert "SwaggerUIBundle" in bundle.text
