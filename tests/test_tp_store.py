"""The TP rendezvous store listens on the address it logs (loopback for a
single node), not on every interface."""

from __future__ import annotations

import time
from pathlib import Path

from aioserve.launch.world import RankSpec, open_store


def _listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state (0A) on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":
                found.add(address)
    return found


def test_single_node_store_listens_on_loopback_only() -> None:
    spec = RankSpec(rank=0, world_size=2, local_rank=0, ranks_per_node=2, host="127.0.0.1", port=0)
    store = open_store(spec, time.monotonic() + 10)
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, little-endian hex
