"""What a router in front of several replicas asks of each one: SGLang's
worker endpoints, answered as an SGLang worker answers them, so that
`sglang-router` and `vllm-router` route to aioserve unchanged.

What the routers call (logged in tests/test_router.py): at registration
`GET /server_info` (the served name, tp/dp sizes) and `GET /model_info`
(falling back to the older `/get_model_info` on a 404); then `GET /health`
every --health-check-interval-secs; `GET /get_load` for the load-aware
policies (power_of_two) and the router's own /get_loads; `POST /flush_cache`
fanned out from the router's; the generation routes themselves. Routes the
router merely passes through (`/get_model_info`, `/get_server_info`,
`/health_generate`, `/version`) answer too. vllm-router first asks
`POST /v1/completions/render` (and the chat twin) and, given a 404, sends
the request on unrendered: those are left unanswered on purpose; it then
calls `POST /tokenize` (token_routes', vLLM's shape) to route by token ids.
`/server_info` itself is ops_routes' (with SGLang's fields among ours).
"""

from __future__ import annotations

import asyncio
import logging
import time
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import Response

from aioserve.config import DEMO_MODEL
from aioserve.sampling_params import SamplingParams
from aioserve.server.context import ServingContext
from aioserve.server.output.generation import Generation, new_id
from aioserve.server.output.pooled import pool_prompts
from aioserve.server.output.service_bodies import ModelInfo, VersionInfo, WorkerLoad
from aioserve.server.wire import json_response

logger = logging.getLogger(__name__)

STEP_POLL_S = 0.02  # how often a busy server's probe looks for a finished step
# /health_generate's one-token generation must end within this (SGLang waits 20 s).
HEALTH_GENERATE_TIMEOUT_S = 20.0


def package_version() -> str:
    try:
        return version("aioserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def model_path(ctx: ServingContext) -> str:
    """--model as given (a Hugging Face id or a folder), as SGLang reports its
    model_path: a router loads its tokenizer from it. The demo model's name
    is neither, so its folder inside the package stands for it."""
    model = ctx.args.engine.model
    if model == DEMO_MODEL:
        from aioserve.models.source import DEMO_MODEL_DIR

        return str(DEMO_MODEL_DIR)
    return model


def architectures(ctx: ServingContext) -> list[str]:
    agreed = ctx.tp_layout[0].get("agreed", {}) if ctx.tp_layout else {}
    return [agreed["architecture"]] if "architecture" in agreed else []


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


async def model_info(request: Request) -> Response:
    ctx = _ctx(request)
    path = model_path(ctx)
    return json_response(
        ModelInfo(
            model_path=path,
            tokenizer_path=ctx.args.engine.tokenizer or path,
            served_model_name=ctx.model_name,
            is_generation=True,
            preferred_sampling_params=None,
            weight_version="default",
            has_image_understanding=ctx.images is not None,
            has_audio_understanding=False,
            architectures=architectures(ctx),
            max_context_length=ctx.max_model_len,
            vocab_size=ctx.vocab_size,
        )
    )


async def get_load(request: Request) -> Response:
    info = _ctx(request).scheduler.info()
    held_pages = info.kv_pages_total - info.kv_pages_free - info.kv_pages_evictable
    load = WorkerLoad(
        dp_rank=0,
        num_reqs=info.running + info.waiting,
        num_waiting_reqs=info.waiting,
        num_tokens=held_pages * info.page_size,
    )
    return Response(f"[{load.model_dump_json()}]", media_type="application/json")


async def health_generate(request: Request) -> Response:
    """SGLang's deeper probe: 503 if the server is draining or failed. A busy
    server answers 200 as soon as the engine finishes a step (a generation
    of its own would wait its turn behind the queue, and a router would take
    a working replica out exactly when load is highest); an idle one once a
    one-token generation came back, 503 if it errs or hangs."""
    ctx = _ctx(request)
    if not ctx.healthy:
        return Response(status_code=503)
    info = ctx.scheduler.info()
    if info.running or info.waiting:
        return Response(status_code=200 if await _steps_advance(ctx, info.stats["steps_done"]) else 503)
    if ctx.pooler is not None:  # a pooling model: one pooled token instead
        return Response(status_code=200 if await _pools_one(ctx) else 503)
    generation = Generation(ctx, new_id("health"))
    try:
        generation.start([[0]], SamplingParams(max_tokens=1, temperature=0.0))
        await asyncio.wait_for(_read_to_end(generation), HEALTH_GENERATE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure is the probe's answer
        logger.warning("health_generate failed: %r", exc)
        generation.close()
        return Response(status_code=503)
    return Response(status_code=200 if generation.error() is None else 503)


async def _pools_one(ctx: ServingContext) -> bool:
    try:
        await asyncio.wait_for(pool_prompts(ctx, [[0]], score=False, param="input"), HEALTH_GENERATE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure is the probe's answer
        logger.warning("health_generate failed: %r", exc)
        return False
    return True


async def _steps_advance(ctx: ServingContext, done: int) -> bool:
    """Whether the scheduler processes a step past `done` within the probe's time."""
    deadline = time.monotonic() + HEALTH_GENERATE_TIMEOUT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(STEP_POLL_S)
        if ctx.scheduler.info().stats["steps_done"] > done:
            return True
        if not ctx.healthy:
            return False
    return False


async def _read_to_end(generation: Generation) -> None:
    async for _ in generation.deltas():
        pass


async def version_info(request: Request) -> Response:
    return json_response(VersionInfo(version=package_version()))

