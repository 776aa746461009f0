"""What operators and load balancers call: /health, /flush_cache, /server_info."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from aioserve.server.context import ServingContext
from aioserve.server.endpoints.worker_routes import model_path, package_version
from aioserve.server.errors import APIError
from aioserve.server.output.service_bodies import FlushCacheResponse, ServerInfo, TensorParallelInfo
from aioserve.server.wire import json_response


async def health(request: Request) -> Response:
    return Response(status_code=200 if request.app.state.ctx.healthy else 503)


async def flush_cache(request: Request) -> Response:
    if not request.app.state.ctx.scheduler.flush_cache():
        raise APIError("cannot flush the prefix cache while requests are running", status=400)
    return json_response(FlushCacheResponse(flushed=True))


async def server_info(request: Request) -> Response:
    """Configuration, KV pool occupancy and scheduler counters (for ops and
    tests); also GET /get_server_info, SGLang's older name."""
    ctx: ServingContext = request.app.state.ctx
    engine = ctx.args.engine
    return json_response(
        ServerInfo(
            model=ctx.model_name,
            max_model_len=ctx.max_model_len,
            overlap=engine.overlap,
            cache=engine.cache,
            tensor_parallel=TensorParallelInfo(tp_size=engine.tp_size, nnodes=engine.nnodes, ranks=ctx.tp_layout),
            served_model_name=ctx.model_name,
            model_path=model_path(ctx),
            tp_size=engine.tp_size,
            dp_size=1,
            max_running_requests=engine.max_running_requests,
            version=package_version(),
            generation_defaults=ctx.generation_defaults,
            **vars(ctx.scheduler.info(check_integrity=True)),  # ServerInfo has SchedulerInfo's fields
        )
    )
