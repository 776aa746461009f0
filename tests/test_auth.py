"""--api-key (or AIOSERVE_API_KEY) guards every route but /health, /metrics
and the chat page, with a 401 in OpenAI's error shape."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from server_harness import start_server

KEY = "sk-test-key"
GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/stories260K", None),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/generate", {"text": "Once", "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/tokenize", {"prompt": "Once"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/flush_cache", None),
    ("GET", "/server_info", None),
]
OPEN = ["/health", "/metrics", "/", "/docs", "/openapi.json"]


@pytest.fixture(scope="module")
def guarded_server(stories_path: Path):
    # The key comes from the environment: the flag's documented fallback.
    os.environ["AIOSERVE_API_KEY"] = KEY
    try:
        server = start_server(stories_path, "--served-model-name", "stories260K", "--page-size", "4")
    finally:
        del os.environ["AIOSERVE_API_KEY"]
    yield server
    server.stop()


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_guarded_routes_want_the_key(guarded_server, method: str, path: str, body: dict | None) -> None:
    url = guarded_server.url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        denied = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert denied.status_code == 401, (path, headers)
        error = denied.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    allowed = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert allowed.status_code != 401 and allowed.status_code < 500, (path, allowed.text)


@pytest.mark.parametrize("path", OPEN)
def test_probes_metrics_and_the_page_stay_open(guarded_server, path: str) -> None:
    assert httpx.get(guarded_server.url + path, timeout=30).status_code == 200


def test_the_bearer_scheme_is_case_insensitive(guarded_server) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        response = httpx.get(f"{guarded_server.url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=10)
        assert response.status_code == 200, scheme
    wrong = httpx.get(f"{guarded_server.url}/v1/models", headers={"Authorization": f"Basic {KEY}"}, timeout=10)
    assert wrong.status_code == 401


def test_openapi_declares_the_key_when_one_is_set(guarded_server) -> None:
    response = httpx.get(f"{guarded_server.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    document = response.json()
    assert document["security"] == [{"apiKey": []}]
    assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
