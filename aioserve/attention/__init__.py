"""Attention backends: per-batch metadata, per-layer attention over the paged KV pool."""

from __future__ import annotations

import torch

from aioserve.attention.backend import AttentionBackend, AttentionMetadata
from aioserve.kvcache.kv_pool import KVPool

BACKENDS = ("auto", "torch_native")


def create_backend(name: str, pool: KVPool) -> AttentionBackend:
    """`torch_native` runs on CPU and GPU; it is what `auto` picks today."""
    if name in ("auto", "torch_native"):
        from aioserve.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend(pool)
    raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "create_backend"]
