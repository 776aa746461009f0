"""Per-process bootstrap: one uvloop event loop that runs hypercorn (the
starlette app), the tokenizer's thread pool, the scheduler coroutine and the
loop-lag timer, then shuts them down.

Shutting down, two ways:
* SIGTERM/SIGINT drains: /health and new requests answer 503 at once,
  running requests get --shutdown-timeout seconds to finish, the rest are
  aborted (each stream gets its last event), and the process exits 0.
  A second signal exits at once.
* A failure exits 1, so that a restart policy brings the server back: the
  scheduler loop dying, or (under tensor parallelism) the group breaking (a
  rank died or a step failed). /health answers 503 at once, the listener
  closes a moment later; a watchdog exits hard if the orderly path hangs on a
  collective.

Under tensor parallelism this process is rank 0 (node 0), and building the
scheduler starts node 0's follower ranks. `aioserve serve --node-rank K`
(K > 0) runs only that node's follower ranks: no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Coroutine

from aioserve.config import ServerArgs
from aioserve.launch.follower import run_node
from aioserve.launch.world import DistributedInitError, is_distributed
from aioserve.launch.wiring import build_scheduler
from aioserve.server.context import InFlight, ServingContext
from aioserve.server.endpoints.app import create_app
from aioserve.server.intake.generation_defaults import load_generation_defaults
from aioserve.images import MediaSettings, load_image_intake
from aioserve.tokenizer import Tokenizer, started_pool

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 1.0  # /health answers 503 this long before the listener closes
LAST_EVENTS_S = 2.0  # after aborting what outlived --shutdown-timeout, for their final events to go out
HARD_EXIT_S = 8.0  # after a failure, exit by force if still running (the issue allows 10 s)
# Threads that read a vision-language model's images (fetches wait on the
# network, so more than the tokenizer's; each is bounded by --media-fetch-timeout).
MEDIA_WORKERS = 8


class FatalFailure:
    """The reaction to what the server cannot serve on after: a broken
    tensor-parallel group, a dead scheduler loop. Called from any thread (the
    lifeline watcher, the forward thread) or from the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        self.loop = loop
        self.stop = stop
        self.reason: str | None = None
        self.ctx: ServingContext | None = None

    def __call__(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        threading.Thread(target=self._watchdog, name="aioserve-exit-watchdog", daemon=True).start()
        self.loop.call_soon_threadsafe(self._on_loop)

    def attach(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _on_loop(self) -> None:
        # A finished scheduler task is what /health reports as 503.
        if self.ctx is not None and self.ctx.scheduler_task is not None:
            self.ctx.scheduler_task.cancel()
        if self.ctx is not None:  # every running request ends with a clean error, not a cut connection
            self.ctx.failure = self.reason
            for generation in list(self.ctx.generations):
                generation.fail(f"the server failed and is exiting: {self.reason}")
        self.loop.call_later(FAILURE_GRACE_S, self.stop.set)

    def _watchdog(self) -> None:
        threading.Event().wait(HARD_EXIT_S)
        logger.error("shutdown after a failure did not finish within %.0f s; exiting now", HARD_EXIT_S)
        logging.shutdown()
        os._exit(1)


async def serve(args: ServerArgs) -> str | None:
    """Serve until a signal (returns None, after draining) or a failure
    (returns its reason)."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    failure = FatalFailure(loop, stop)
    early = _load_tokenizer_beside_the_engine(args)
    try:
        engine, scheduler = build_scheduler(args.engine, on_tp_failure=failure)
    finally:
        tokenizer_loaded = early.result() if early is not None else None  # (a failed start waits for it too)
    tokenizer = tokenizer_loaded or Tokenizer(
        args.engine.tokenizer or engine.model_path, args.chat_template, args.tokenizer_workers
    )
    try:
        images = load_image_intake(
            engine.model_path, MediaSettings.from_args(args), tokenizer.run_async,
            partial(started_pool, MEDIA_WORKERS, "aioserve-media"), tokenizer.rust.token_to_id,
        )
    except Exception:  # a vision-language checkpoint whose image processor cannot load
        scheduler.shutdown()
        tokenizer.shutdown()
        raise
    ctx = ServingContext(
        args, scheduler, tokenizer, engine.max_model_len, engine.vocab_size, tp_layout=engine.tp_layout,
        generation_defaults=load_generation_defaults(args.generation_config, engine.model_path),
        pooler=engine.pooler, hidden_size=engine.model_config.hidden_size,
        score_row=engine.score_row, pooling_causal=not engine.model_config.is_encoder, images=images,
    )
    ctx.scheduler_task = asyncio.create_task(scheduler.run(), name="scheduler")
    ctx.scheduler_task.add_done_callback(partial(_on_scheduler_exit, failure))
    failure.attach(ctx)
    lag_timer = asyncio.create_task(ctx.metrics.watch_loop_lag(), name="loop-lag")

    drain = Drain(ctx, stop, args.shutdown_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain.on_signal, sig)

    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = logging.getLogger("hypercorn.access") if args.access_log else None
    config.backlog = args.backlog
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 3.0
    if args.ssl_certfile is not None:  # HTTPS (ServerArgs checks the key comes with it)
        config.certfile, config.keyfile = args.ssl_certfile, args.ssl_keyfile
    logger.info(
        "serving %s as %r at %s://%s:%d (KV pool: %d tokens, max context %d, overlap %s, cache %s, tp %d)",
        engine.model_path, args.model_name, "https" if args.ssl_certfile else "http", args.host, args.port,
        engine.kv_capacity_tokens, engine.max_model_len, "on" if args.engine.overlap else "off", args.engine.cache, args.engine.tp_size,
    )
    try:
        if failure.reason is None:  # the group may have broken while we started
            await hypercorn_serve(create_app(ctx), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]  # ASGI scopes: MutableMapping to starlette, TypedDicts to hypercorn
    finally:
        logger.info("shutting down")
        lag_timer.cancel()
        scheduler.stop()
        if not ctx.scheduler_task.done():
            await asyncio.wait({ctx.scheduler_task}, timeout=30)
        scheduler.shutdown()
        tokenizer.shutdown()
        if ctx.images is not None:
            ctx.images.shutdown()
        ctx.response_pool.shutdown(wait=False)
        await ctx.body_parser.close()
    return failure.reason


def _load_tokenizer_beside_the_engine(args: ServerArgs) -> Future[Tokenizer | None] | None:
    """Start loading the tokenizer on a thread of its own, when its folder is
    known before the engine resolves the model (a local folder): its load
    (0.1-0.8 s through load_hf_tokenizer, Qwen's 151k vocabulary the longest;
    ~2.5 s through plain AutoTokenizer) then overlaps the engine's loading
    instead of following it. Its result is None if it failed; the caller then
    loads it again and sees the error."""
    folder = Path(args.engine.tokenizer or args.engine.model).expanduser()
    if not folder.is_dir():
        return None
    pool = ThreadPoolExecutor(1, thread_name_prefix="aioserve-tokenizer-load")

    def load() -> Tokenizer | None:
        try:
            return Tokenizer(folder, args.chat_template, args.tokenizer_workers)
        except Exception:  # noqa: BLE001 - loaded again on the main thread, where it is reported
            return None

    future = pool.submit(load)
    pool.shutdown(wait=False)
    return future


def _on_scheduler_exit(failure: FatalFailure, task: asyncio.Task) -> None:
    """The scheduler loop ends only when told to stop; anything else is fatal."""
    if task.cancelled():
        return
    if task.exception() is not None:
        logger.error("the scheduler loop died; /health now answers 503", exc_info=task.exception())
        failure(f"the scheduler loop died: {task.exception()!r}")


class Drain:
    """SIGTERM/SIGINT: stop taking work, let what runs finish, then stop."""

    def __init__(self, ctx: ServingContext, stop: asyncio.Event, timeout: float) -> None:
        self.ctx = ctx
        self.stop = stop
        self.timeout = timeout
        self.task: asyncio.Task | None = None

    def on_signal(self, signum: int) -> None:
        if self.task is not None:
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            logging.shutdown()
            os._exit(128 + signum)
        logger.info(
            "%s: draining (new requests get 503; running ones have %.0f s to finish; signal again to exit now)",
            signal.Signals(signum).name, self.timeout,
        )
        self.ctx.draining = True
        self.task = asyncio.get_running_loop().create_task(self._run(), name="drain")

    async def _run(self) -> None:
        if not await self._all_finished_within(self.timeout):
            left = self._unfinished()
            logger.warning("aborting %d requests still running after %.0f s", len(left), self.timeout)
            for generation in left:
                generation.abort()  # each stream gets its final (abort) event
            # Let the handlers write those last events before the listener closes.
            await self._all_finished_within(LAST_EVENTS_S)
        self.stop.set()

    async def _all_finished_within(self, seconds: float) -> bool:
        deadline = asyncio.get_running_loop().time() + seconds
        while self._unfinished():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _unfinished(self) -> list[InFlight]:
        return [g for g in list(self.ctx.generations) if not g.finished]


def _run_loop(coroutine: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:  # Windows
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def run_server(args: ServerArgs) -> None:
    """Block running the server on a uvloop event loop (or, on a node other
    than 0, that node's follower ranks)."""
    config = args.engine
    try:
        if is_distributed(config) and config.node_rank > 0:
            sys.exit(run_node(config))
        failure = _run_loop(serve(args))
    except DistributedInitError as exc:
        logger.error("cannot start tensor parallelism: %s", exc)
        sys.exit(1)
    if failure is not None:
        logger.error("exiting with status 1: %s", failure)
        logging.shutdown()
        os._exit(1)  # a forward thread may still be stuck in a collective
