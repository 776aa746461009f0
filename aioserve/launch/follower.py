"""A follower rank: one process, one uvloop event loop, one coroutine that
receives each step's plan from rank 0 and runs the same forward on its shard.

Receiving and forwarding run on one worker thread, so the loop stays free
and an idle follower just sleeps in gloo's receive (no spinning core). The
follower ends when rank 0 says stop (exit 0), or with a log line and exit
code 1 when rank 0 vanishes (its lifeline closes) or a step raises.

Run as `python -m aioserve.launch.follower '<json>'` by the first process
of a node (world.spawn_followers); `run_node` is what `aioserve serve
--node-rank K` (K > 0) runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from aioserve.config import EngineConfig
from aioserve.tp.distributed import destroy_tensor_parallel, init_tensor_parallel
from aioserve.engine.engine import Engine
from aioserve.engine.loading import resolve_device
from aioserve.tp.channel import PlanChannel
from aioserve.tp.lifeline import FollowerLifeline
from aioserve.launch.world import (
    LIFELINE_KEY,
    DistributedInitError,
    RankSpec,
    check_layout,
    init_timeout,
    node_ranks,
    open_store,
    parse_addr,
    rank_config,
    spawn_followers,
    stop_processes,
)

logger = logging.getLogger(__name__)


def _exit_now(code: int) -> None:
    """Leave at once: after a failure a thread may be stuck in a collective
    that would block an orderly interpreter exit."""
    logging.shutdown()
    os._exit(code)


def _next_step(engine: Engine, channel: PlanChannel, lifeline: FollowerLifeline) -> bool:
    """Receive one message and run its step; False on stop."""
    plan = channel.receive()
    if plan is None:
        lifeline.closing = True  # rank 0 said stop: its end closing is expected now
        return False
    # CPU: done when it returns. CUDA: enqueued on the stream; the collectives
    # inside keep this rank in step with the others without a host sync.
    engine.launch(plan)
    return True


async def follow(engine: Engine, channel: PlanChannel, lifeline: FollowerLifeline) -> None:
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioserve-follower") as thread:
        while await loop.run_in_executor(thread, _next_step, engine, channel, lifeline):
            pass


def _run_loop(coroutine: Any) -> None:
    try:
        import uvloop
    except ImportError:  # Windows
        asyncio.run(coroutine)
        return
    uvloop.run(coroutine)


def run_rank(spec: RankSpec, config: EngineConfig) -> int:
    """Join the group as follower `spec.rank`, load the shard, follow rank 0
    until it says stop. Returns the exit code."""
    deadline = time.monotonic() + init_timeout()
    try:
        store = open_store(spec, deadline)
        lifeline_port = int(store.get(LIFELINE_KEY))
        lifeline = FollowerLifeline(spec.host, lifeline_port, spec.rank, deadline)
    except DistributedInitError as exc:
        logger.error("rank %d: %s", spec.rank, exc)
        return 1
    except Exception as exc:
        logger.error("rank %d: could not join rank 0 at %s:%d: %s", spec.rank, spec.host, spec.port, exc)
        return 1

    def leader_lost() -> None:
        logger.error("rank %d: rank 0 exited or became unreachable; exiting", spec.rank)
        _exit_now(1)

    lifeline.watch(leader_lost)
    try:
        init_tensor_parallel(spec.rank, spec.world_size, store, resolve_device(config.device))
        engine = Engine(config)
        _run_loop(follow(engine, PlanChannel(), lifeline))
    except Exception:
        # A collective fails when a peer dies; if that peer is rank 0, the
        # lifeline says so in one line within moments (and exits). Otherwise
        # this rank failed on its own: show why.
        time.sleep(0.5)
        logger.exception("rank %d failed; exiting", spec.rank)
        _exit_now(1)
    destroy_tensor_parallel()
    lifeline.close()  # rank 0 waits for this before it closes its end
    logger.info("rank %d stopped", spec.rank)
    return 0


def run_node(config: EngineConfig) -> int:
    """`aioserve serve --node-rank K` (K > 0): this node's ranks, no HTTP.
    This process is the node's first rank; it starts the others."""
    check_layout(config)
    host, port = parse_addr(config.dist_init_addr or "")
    specs = node_ranks(config, host, port)
    own_config = rank_config(config, specs[0])
    processes = spawn_followers(specs[1:], config)
    try:
        code = run_rank(specs[0], own_config)
    finally:
        stop_processes(processes, timeout=10.0)
    return max([code] + [p.returncode or 0 for _, p in processes])


def main(argv: list[str]) -> int:
    message = json.loads(argv[0])
    spec = RankSpec(**message["spec"])
    logging.basicConfig(
        level=message["log_level"],
        format=f"%(asctime)s %(levelname)s [rank {spec.rank}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides
    # when followers stop (it sends stop, or its lifeline closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return run_rank(spec, EngineConfig(**message["config"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
