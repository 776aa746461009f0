"""Attention backends: per-batch metadata, per-layer attention over the paged KV pool."""

from __future__ import annotations

import logging

import torch

from aioserve.attention.backend import AttentionBackend, AttentionMetadata, AttentionShape
from aioserve.kvcache.kv_pool import KVPool
from aioserve.layers import flashinfer_elementwise

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch_native", "flashinfer")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # what its paged kernels are built for


def flashinfer_unusable(pool: KVPool, shape: AttentionShape) -> str | None:
    """Why FlashInfer cannot serve this engine, or None if it can."""
    if pool.buffer.device.type != "cuda":
        return "it needs CUDA"
    if shape.q_dtype not in FLASHINFER_DTYPES or pool.dtype not in FLASHINFER_DTYPES:
        return f"its kernels take float16/bfloat16, not {shape.q_dtype} math over a {pool.dtype} cache"
    if shape.head_dim not in FLASHINFER_HEAD_DIMS:
        return f"its kernels take head dims {FLASHINFER_HEAD_DIMS}, not {shape.head_dim}"
    if flashinfer_elementwise.load_flashinfer() is None:
        why = flashinfer_elementwise.import_error
        return f"flashinfer does not import ({why}; install the gpu extra: pip install 'aioserve[gpu]')"
    return None


def create_backend(name: str, pool: KVPool, shape: AttentionShape) -> AttentionBackend:
    """`flashinfer` on CUDA in half precision; `torch_native` anywhere (the
    reference). `auto` takes flashinfer where it can serve, else torch_native
    and says why once."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name in ("auto", "flashinfer"):
        reason = flashinfer_unusable(pool, shape)
        if reason is None:
            from aioserve.attention.flashinfer import FlashInferBackend

            return FlashInferBackend(pool, shape)
        if name == "flashinfer":
            raise ValueError(f"--attention-backend flashinfer: {reason}")
        if pool.buffer.device.type == "cuda":
            logger.info("attention: torch_native, not flashinfer, because %s", reason)
    from aioserve.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(pool)


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionShape", "BACKENDS", "FLASHINFER_HEAD_DIMS", "create_backend"]
