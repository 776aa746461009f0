"""Per-process bootstrap: one uvloop event loop that runs hypercorn (the
starlette app), the tokenizer's thread pool and the scheduler coroutine,
then shuts them down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from aioserve.config import ServerArgs
from aioserve.scheduler.factory import build_scheduler
from aioserve.server.app import create_app
from aioserve.server.context import ServingContext
from aioserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


async def serve(args: ServerArgs) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    engine, scheduler = build_scheduler(args.engine)
    tokenizer = Tokenizer(args.engine.tokenizer or engine.model_path, args.chat_template, args.tokenizer_workers)
    ctx = ServingContext(args, scheduler, tokenizer, engine.max_model_len, engine.vocab_size)
    ctx.scheduler_task = asyncio.create_task(scheduler.run(), name="scheduler")
    ctx.scheduler_task.add_done_callback(_report_scheduler_exit)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 3.0
    logger.info(
        "serving %s as %r at http://%s:%d (KV pool: %d tokens, max context %d, overlap %s, cache %s)",
        engine.model_path, args.model_name, args.host, args.port, engine.kv_capacity_tokens,
        engine.max_model_len, "on" if args.engine.overlap else "off", args.engine.cache,
    )
    try:
        await hypercorn_serve(create_app(ctx), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        logger.info("shutting down")
        scheduler.stop()
        await asyncio.wait_for(ctx.scheduler_task, timeout=30)
        scheduler.shutdown()
        tokenizer.shutdown()


def _report_scheduler_exit(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the scheduler loop died; /health now answers 503", exc_info=task.exception())


def run_server(args: ServerArgs) -> None:
    """Block running the server on a uvloop event loop."""
    try:
        import uvloop
    except ImportError:  # Windows
        asyncio.run(serve(args))
        return
    uvloop.run(serve(args))
