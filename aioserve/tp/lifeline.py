"""Lifelines: one TCP connection from each follower to rank 0, carrying no
data. Its only job is to close: the kernel closes a dead process's sockets
at once (kill -9 included), and TCP keepalive notices a machine that vanished
within a few seconds. So

* rank 0 learns that a follower died even while idle (no collective is
  running that could fail), and
* a follower learns that rank 0 died even while it waits for a plan that
  will never come.

Collectives cannot do this: an idle rank is in none, and NCCL would wait
forever. An orderly stop marks the lifeline closing first, so the closures
it causes are not reported as failures.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_RANK = struct.Struct("<i")


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle peer after 2 s, every 1 s, give up after 3 misses."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class LeaderLifeline:
    """Rank 0's end: a listening socket, then one connection per follower."""

    def __init__(self, bind_host: str) -> None:
        self.server = socket.create_server((bind_host, 0))
        self.port: int = self.server.getsockname()[1]
        self.peers: dict[int, socket.socket] = {}
        self.closing = False
        self.watching = False

    def accept(self, ranks: set[int], deadline: float, still_possible: Callable[[], None]) -> None:
        """Wait until every rank in `ranks` has connected. `still_possible`
        raises when waiting longer is pointless (a local follower exited)."""
        self.server.settimeout(0.2)
        while not ranks <= set(self.peers):
            still_possible()
            if time.monotonic() > deadline:
                missing = sorted(ranks - set(self.peers))
                raise TimeoutError(f"rank(s) {missing} did not join")
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            conn.settimeout(5)
            rank = _RANK.unpack(conn.recv(_RANK.size, socket.MSG_WAITALL))[0]
            conn.settimeout(None)
            _keepalive(conn)
            self.peers[rank] = conn
        self.server.close()

    def watch(self, on_lost: Callable[[int], None]) -> None:
        """Call `on_lost(rank)` (on a daemon thread) when a follower's
        connection closes, unless the lifeline is closing."""
        self.watching = True

        def run() -> None:
            selector = selectors.DefaultSelector()
            for rank, conn in self.peers.items():
                selector.register(conn, selectors.EVENT_READ, (rank, conn))
            while self.peers:
                for key, _ in selector.select():
                    rank, peer = key.data
                    try:
                        data = peer.recv(1)
                    except OSError:
                        data = b""
                    if data:
                        continue  # nothing is ever sent; ignore stray bytes
                    selector.unregister(key.fileobj)
                    self.peers.pop(rank, None)
                    if not self.closing:
                        on_lost(rank)
                        return

        threading.Thread(target=run, name="aioserve-lifeline", daemon=True).start()

    def wait_disconnected(self, timeout: float) -> None:
        """After an orderly stop: give followers `timeout` seconds to hang up
        first, so none of them mistakes rank 0's hanging up for its death."""
        deadline = time.monotonic() + timeout
        while self.watching and self.peers and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        """Cut every follower's lifeline (they exit if they have not yet)."""
        self.closing = True
        self.server.close()
        for conn in list(self.peers.values()):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class FollowerLifeline:
    """A follower's end: connected to rank 0 at start-up."""

    def __init__(self, host: str, port: int, rank: int, deadline: float) -> None:
        self.closing = False
        while True:
            try:
                self.conn = socket.create_connection((host, port), timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.conn.sendall(_RANK.pack(rank))
        self.conn.settimeout(None)
        _keepalive(self.conn)

    def watch(self, on_lost: Callable[[], None]) -> None:
        """Call `on_lost()` (on a daemon thread) when rank 0's end closes,
        unless this side is closing."""

        def run() -> None:
            while True:
                try:
                    data = self.conn.recv(1)
                except OSError:
                    data = b""
                if not data:
                    break
            if not self.closing:
                on_lost()

        threading.Thread(target=run, name="aioserve-lifeline", daemon=True).start()

    def close(self) -> None:
        self.closing = True
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()
