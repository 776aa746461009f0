"""The server's memory does not creep (issue 31, item 10).

The creep was the CPU KV pool becoming resident a page at a time: the radix
cache keeps finished prefixes, so the allocator kept handing out pages no
request had written before, and RSS grew ~6-9 KB per request until the whole
pool had been written. The pool is now written at startup; after warm-up the
RSS of a server answering thousands of mixed requests (completions and chat,
streamed and not, clients leaving early, malformed bodies) stays flat."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from server_harness import start_server

from aioserve.kvcache.kv_pool import KVPool

SOAK_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_soak.py"
WARMUP = 1000
REQUESTS = 5000
MAX_GROWTH_PER_REQUEST = 3000  # bytes; the creep was ~7,500 (5,000-12,000 between checkpoints), now ~1,000


def _soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("memory_soak_under_test", SOAK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_cpu_kv_pool_is_resident_once_built() -> None:
    """The pool's memory is written when it is made, not by the requests that
    later use its pages: RSS rises by the pool's size at once."""
    rss_bytes = _soak_module().rss_bytes
    before = rss_bytes(os.getpid())
    pool = KVPool(4, 2049, 16, 4, 64, torch.float32, torch.device("cpu"))  # 64 MiB + a reserved page
    grown = rss_bytes(os.getpid()) - before
    size = pool.buffer.numel() * pool.buffer.element_size()
    assert grown >= 0.95 * size, f"RSS grew {grown / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB pool"
    assert not pool.buffer.any()  # written with zeros: padded positions read finite numbers


@pytest.mark.slow
def test_rss_stays_flat_over_5000_mixed_requests(stories_path: Path) -> None:
    soak = _soak_module()
    server = start_server(stories_path)
    try:
        checkpoints = asyncio.run(
            soak.soak(server, REQUESTS, concurrency=32, every=500, max_tokens=16, seed=0, idle_s=0.0)
        )
        per_request = soak.print_table(checkpoints, WARMUP)
        assert per_request < MAX_GROWTH_PER_REQUEST, f"RSS grew {per_request:.0f} bytes per request after warm-up"
        info = server.info()
        assert info["running"] == 0 and info["kv_integrity"] == "ok"
    finally:
        server.stop()
