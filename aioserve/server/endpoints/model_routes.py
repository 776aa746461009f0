"""GET /v1/models and /v1/models/{model}: the one model this server serves."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.context import ServingContext
from aioserve.server.output.service_bodies import ModelCard, ModelList
from aioserve.server.wire import json_response


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(
        id=ctx.model_name,
        created=ctx.started_at,
        owned_by="aioserve",
        root=str(ctx.args.engine.model),
        max_model_len=ctx.max_model_len,
    )


async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=[_model_card(request.app.state.ctx)]))


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model}; ids may hold slashes ("Qwen/Qwen3-0.6B")."""
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(request.path_params["model"])
    return json_response(_model_card(ctx))
