"""Under tensor parallelism, rank 0 pings the followers while no step runs.

A follower that hangs (SIGSTOPped, deadlocked) keeps its lifeline open, so
only a collective that does not complete reveals it: while steps flow, the
step's bound does (launch/leader.py); on an idle server nothing ran, and
the hang was noticed only when the next request's step timed out (33 s
after it came). Here, once no step has been in flight for IDLE_PING_S, a
ping goes to the followers every IDLE_PING_S, each answered within a step's
bound, or the group fails (/health 503).

The ping is submitted to the executor's step thread, the one that
broadcasts plans, so it is never sent beside a plan and reaches the
followers in order with them; while steps flow, none is sent.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Protocol

logger = logging.getLogger(__name__)

# Idle this long, the followers are pinged, and again every as long while idle.
IDLE_PING_S = 2.0


class Pinged(Protocol):
    """What the heartbeat needs of rank 0's TPLeader."""

    @property
    def failed(self) -> bool: ...

    def ping(self) -> None: ...

    def fail_after_error(self, what: str, exc: BaseException) -> str: ...


class IdleHeartbeat:
    def __init__(
        self, leader: Pinged, step_thread: concurrent.futures.ThreadPoolExecutor, interval: float = IDLE_PING_S
    ) -> None:
        self._leader = leader
        self._step_thread = step_thread
        self._interval = interval
        self._lock = threading.Lock()
        self._in_flight = 0  # steps (and a ping) submitted and not yet done
        self._last = time.monotonic()  # when the last one was submitted or finished
        self._stopped = False
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="aioserve-tp-heartbeat", daemon=True).start()

    def step_submitted(self, done: concurrent.futures.Future) -> None:
        """A step went to the step thread; `done` completes with it."""
        with self._lock:
            self._in_flight += 1
            self._last = time.monotonic()
        done.add_done_callback(self._finished)

    def _finished(self, _: object = None) -> None:
        with self._lock:
            self._in_flight -= 1
            self._last = time.monotonic()

    def stop(self) -> None:
        """No ping is submitted after this returns (before the followers are told to stop)."""
        with self._lock:
            self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._wake.wait(self._interval / 4):
            with self._lock:
                if self._stopped or self._leader.failed:
                    return
                if self._in_flight or time.monotonic() - self._last < self._interval:
                    continue
                self._in_flight += 1
                self._last = time.monotonic()
                try:  # under the lock: stop() then finds it queued ahead of the followers' stop
                    future = self._step_thread.submit(self._ping)
                except RuntimeError:  # the step thread is shutting down
                    return
            future.add_done_callback(self._finished)

    def _ping(self) -> None:
        try:
            self._leader.ping()
        except Exception as exc:  # a collective that raised: a peer went away (the lifeline names it)
            self._leader.fail_after_error("an idle heartbeat", exc)
