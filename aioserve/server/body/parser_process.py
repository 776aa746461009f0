"""Request bodies parsed off the event loop: a body of BODY_WORKER_BYTES or
more goes to one worker process (body/worker.py), which parses it and
applies the per-request bounds; only a body within them comes back (as a
pickle, whose load costs a fraction of json.loads and pydantic's work). A
15 MiB body of token ids took the loop 3.5-4.5 s to parse and validate on
the loop's own thread; a thread would not help, json.loads holds the GIL."""

from __future__ import annotations

import asyncio
import logging
import pickle
import sys
from pathlib import Path
from typing import Any

from aioserve.server.body.checks import BodyRejected, RequestLimits

logger = logging.getLogger(__name__)

# Below this, json.loads and the checks take the loop about a millisecond or
# two (at most ~128k token ids); the worker's round trip would cost as much.
BODY_WORKER_BYTES = 256 << 10

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
FRAME_HEADER_BYTES = 8


class BodyParserProcess:
    """One worker, started at its first body, one body at a time (large
    bodies are rare; a queue of them waits off the loop)."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def decode(self, raw: bytes, limits: RequestLimits, known: frozenset[str]) -> tuple[dict[str, Any], list[str]]:
        frame = pickle.dumps((raw, limits.as_dict(), sorted(known)), protocol=pickle.HIGHEST_PROTOCOL)
        # Shielded: a client that leaves must not cut the exchange in half
        # (the next body would read this one's answer).
        reply = await asyncio.shield(self._exchange(frame))
        answer = pickle.loads(reply)
        if answer[0] == "rejected":
            raise BodyRejected(*answer[1:])
        return answer[1], answer[2]

    async def _exchange(self, frame: bytes) -> bytes:
        async with self._lock:
            process = await self._started()
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write(len(frame).to_bytes(FRAME_HEADER_BYTES, "big") + frame)
                await process.stdin.drain()
                size = int.from_bytes(await process.stdout.readexactly(FRAME_HEADER_BYTES), "big")
                return await process.stdout.readexactly(size)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                self._process = None
                logger.warning("the body parser process ended (%r); starting another for the next body", exc)
                raise BodyRejected("the request body could not be parsed", None) from None

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is None or self._process.returncode is not None:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, str(WORKER_SCRIPT), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )
        return self._process

    async def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 2.0)
            except asyncio.TimeoutError:
                process.kill()
