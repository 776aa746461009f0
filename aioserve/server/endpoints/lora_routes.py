"""Loading and unloading LoRA adapters at run time (--enable-lora).

vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` answer in
plain text, as vLLM does; SGLang's `/load_lora_adapter` and
`/unload_lora_adapter` take the same fields and answer SGLang's JSON
(`success`, `error_message`, `loaded_adapters`). The adapter's folder is
read and checked off the event loop (Scheduler.load_adapter); a folder that
cannot be served is a 400 saying why, an unknown name to unload a 404.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from aioserve.lora_config import AdapterError
from aioserve.server.context import ServingContext
from aioserve.server.errors import APIError
from aioserve.server.intake.lora_requests import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from aioserve.server.intake.request_body import parse_body
from aioserve.server.output.service_bodies import LoraAdapterUpdate
from aioserve.server.wire import json_response


def _serving(ctx: ServingContext) -> None:
    if not ctx.scheduler.serves_adapters:
        raise APIError("LoRA adapters are not served: start the server with --enable-lora", code="lora_not_enabled")


async def _load(request: Request) -> str:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, LoadLoraAdapterRequest)
    _serving(ctx)
    if body.lora_name == ctx.model_name:
        raise APIError(f"`{body.lora_name}` is the base model's name", param="lora_name")
    try:
        await ctx.scheduler.load_adapter(body.lora_name, body.lora_path)
    except AdapterError as exc:
        raise APIError(str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return body.lora_name


async def _unload(request: Request) -> str:
    ctx: ServingContext = request.app.state.ctx
    body = await parse_body(request, UnloadLoraAdapterRequest)
    _serving(ctx)
    if not ctx.scheduler.unload_adapter(body.lora_name):
        raise APIError(f"The LoRA adapter `{body.lora_name}` cannot be found.", status=404, param="lora_name",
                       code="lora_not_found")
    return body.lora_name


async def load_lora_adapter(request: Request) -> Response:
    name = await _load(request)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    name = await _unload(request)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _update(request: Request) -> Response:
    info = request.app.state.ctx.scheduler.info().lora
    return json_response(LoraAdapterUpdate(success=True, loaded_adapters=info.adapters if info else {}))


async def load_lora_adapter_sglang(request: Request) -> Response:
    await _load(request)
    return _update(request)


async def unload_lora_adapter_sglang(request: Request) -> Response:
    await _unload(request)
    return _update(request)
