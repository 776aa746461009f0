"""--allowed-origins: CORS for pages served elsewhere, preflight included,
with the headers on the API-key check's 401 too."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from aioserve.server.endpoints.app import build_middleware, parse_origins
from server_harness import start_server

GOOD = "http://good.example:3000"
ALSO_GOOD = "https://also.example"
BAD = "http://evil.example"
KEY = "s3cret"


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(
        f"{url}/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )


def chat(url: str, origin: str, key: str | None) -> httpx.Response:
    headers = {"Origin": origin} | ({"Authorization": f"Bearer {key}"} if key else {})
    body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def cors_server(stories_path):
    # A trailing slash and spaces, as people type them.
    server = start_server(stories_path, "--allowed-origins", f" {GOOD}/, {ALSO_GOOD}", "--api-key", KEY)
    yield server
    server.stop()


@pytest.mark.parametrize("origin", [GOOD, ALSO_GOOD])
def test_preflight_from_allowed_origin(cors_server, origin: str) -> None:
    response = preflight(cors_server.url, origin)
    assert response.status_code == 200, response.text  # not 401: a preflight carries no key
    assert response.headers["access-control-allow-origin"] == origin
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed_headers = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers


def test_allowed_origin_gets_headers_on_success_and_on_401(cors_server) -> None:
    ok = chat(cors_server.url, GOOD, KEY)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == GOOD
    # The page must be able to read "bad key" rather than see an opaque failure.
    denied = chat(cors_server.url, GOOD, "wrong")
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == GOOD
    assert denied.json()["error"]["code"] == "invalid_api_key"


def test_disallowed_origin_gets_no_headers(cors_server) -> None:
    response = preflight(cors_server.url, BAD)
    assert "access-control-allow-origin" not in response.headers
    assert response.status_code == 400
    actual = chat(cors_server.url, BAD, KEY)
    assert actual.status_code == 200  # CORS is the browser's business; the server still answers
    assert "access-control-allow-origin" not in actual.headers


def test_only_a_real_preflight_skips_the_key(cors_server) -> None:
    """Only a real preflight skips the key check: a bare OPTIONS is an ordinary request."""
    response = httpx.options(f"{cors_server.url}/v1/models", headers={"Origin": GOOD}, timeout=30)
    assert response.status_code == 401


def test_no_cors_without_the_option(stories_server) -> None:
    response = preflight(stories_server.url, GOOD)
    assert "access-control-allow-origin" not in response.headers
    assert response.status_code == 405  # the route does not take OPTIONS
    models = httpx.get(f"{stories_server.url}/v1/models", headers={"Origin": GOOD}, timeout=30)
    assert models.status_code == 200
    assert not any(name.startswith("access-control-") for name in models.headers)


def test_parse_origins() -> None:
    assert parse_origins(None) == []
    assert parse_origins(" , ") == []
    assert parse_origins("*") == ["*"]
    assert parse_origins(f"{GOOD}/ ,{ALSO_GOOD}") == [GOOD, ALSO_GOOD]


def test_any_origin_with_api_key() -> None:
    """`*` in process, on a bare app with the same middleware stack."""

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"data": []})

    app = Starlette(routes=[Route("/v1/models", models)], middleware=build_middleware("*", KEY))
    with TestClient(app) as client:
        pre = client.options(
            "/v1/models", headers={"Origin": BAD, "Access-Control-Request-Method": "GET"}
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        denied = client.get("/v1/models", headers={"Origin": BAD})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
        ok = client.get("/v1/models", headers={"Origin": BAD, "Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
