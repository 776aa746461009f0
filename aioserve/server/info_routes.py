"""GET /version (vLLM's) and GET /get_model_info (SGLang's): what scripts
written for those servers ask before they send work."""

from __future__ import annotations

import importlib.metadata

from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.context import ServingContext
from aioserve.server.wire import WireModel, json_response


def package_version() -> str:
    """The installed distribution's version."""
    try:
        return importlib.metadata.version("aioserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class VersionResponse(WireModel):
    version: str


class ModelInfo(WireModel):
    """SGLang's fields; `is_generation` is always true (no embedding models here)."""

    model_path: str
    tokenizer_path: str
    is_generation: bool
    served_model_name: str
    max_model_len: int
    weight_version: str = "default"


async def version(request: Request) -> Response:
    return json_response(VersionResponse(version=package_version()))


async def get_model_info(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    path = str(ctx.args.engine.model)
    return json_response(ModelInfo(
        model_path=path, tokenizer_path=str(getattr(ctx.args.engine, "tokenizer", None) or path), is_generation=True,
        served_model_name=ctx.model_name, max_model_len=ctx.max_model_len,
    ))
