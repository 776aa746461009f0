"""The OpenAPI 3.1 document of the route table: every endpoint that
endpoints/routes.py lists, with the schemas of schemas.py. It depends on no
runtime state, so endpoints/routes.py builds it once per process."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from typing import Any

from aioserve.server.openapi.endpoint import Endpoint
from aioserve.server.openapi.schemas import all_schemas

OPENAPI_VERSION = "3.1.0"


def _version() -> str:
    """The installed distribution's version (the package root is above this module)."""
    try:
        return importlib.metadata.version("aioserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def paths(endpoints: Sequence[Endpoint]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for endpoint in endpoints:
        out.setdefault(endpoint.openapi_path, {})[endpoint.method.lower()] = endpoint.operation
    return out


def document_bytes(endpoints: Sequence[Endpoint], secured: bool) -> bytes:
    """With an API key, the bearer scheme applies to every route but the
    open ones; without one, the document declares no security at all."""
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "aioserve",
            "version": _version(),
            "description": "OpenAI-compatible (and SGLang /generate) LLM inference server.",
        },
        "paths": paths(endpoints),
        "components": {"schemas": all_schemas()},
    }
    if secured:
        document["components"]["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "the server's --api-key (or AIOSERVE_API_KEY)"}
        }
        document["security"] = [{"apiKey": []}]
    return json.dumps(document).encode()
