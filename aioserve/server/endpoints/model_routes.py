"""GET /v1/models and /v1/models/{model}: the model this server serves and
its LoRA adapters, each with `parent` naming the base (as vLLM lists them)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.context import ServingContext
from aioserve.server.output.service_bodies import ModelCard, ModelList
from aioserve.server.wire import json_response


def _model_card(ctx: ServingContext, adapter: str | None = None, path: str = "") -> ModelCard:
    return ModelCard(
        id=adapter or ctx.model_name,
        created=ctx.started_at,
        owned_by="aioserve",
        root=path if adapter else str(ctx.args.engine.model),
        max_model_len=ctx.max_model_len,
        parent=ctx.model_name if adapter else None,
    )


async def list_models(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    lora = ctx.scheduler.info().lora
    adapters = [_model_card(ctx, name, path) for name, path in (lora.adapters if lora else {}).items()]
    return json_response(ModelList(data=[_model_card(ctx), *adapters]))


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model}; ids may hold slashes ("Qwen/Qwen3-0.6B")."""
    ctx: ServingContext = request.app.state.ctx
    adapter = ctx.check_model(request.path_params["model"])
    return json_response(_model_card(ctx, adapter.name, adapter.path) if adapter else _model_card(ctx))
