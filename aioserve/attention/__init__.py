"""Attention backends: per-batch metadata, per-layer attention over the paged KV pool."""

from __future__ import annotations

import logging

from aioserve.attention.backend import AttentionBackend, AttentionMetadata, AttentionShape, check_non_causal_plan
from aioserve.config import ConfigError
from aioserve.flashinfer import contracts, loader
from aioserve.kvcache.kv_pool import KVPool

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch_native", "flashinfer")
FLASHINFER_HEAD_DIMS = contracts.PAGED_HEAD_DIMS  # what its paged kernels are built for


def flashinfer_unusable(pool: KVPool, shape: AttentionShape) -> str | None:
    """Why FlashInfer cannot serve this engine, or None if it can."""
    if pool.buffer.device.type != "cuda":
        return "it needs CUDA"
    why = contracts.paged_attention(shape.head_dim, shape.q_dtype, pool.dtype)
    if why is not None:
        return why
    if loader.load_flashinfer() is None:
        why = loader.FLASHINFER.import_error
        return f"flashinfer does not import ({why}; install the gpu extra: pip install 'aioserve[gpu]')"
    return None


def create_backend(name: str, pool: KVPool, shape: AttentionShape) -> AttentionBackend:
    """`flashinfer` on CUDA in half precision; `torch_native` anywhere (the
    reference). `auto` takes flashinfer where it can serve, else torch_native
    and says why once."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name in ("auto", "flashinfer"):
        reason = flashinfer_unusable(pool, shape)
        if reason is None:
            from aioserve.attention.flashinfer import FlashInferBackend

            return FlashInferBackend(pool, shape)
        if name == "flashinfer":
            raise ConfigError(f"--attention-backend flashinfer: {reason}")
        if pool.buffer.device.type == "cuda":
            logger.info("attention: torch_native, not flashinfer, because %s", reason)
    from aioserve.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(pool, causal=shape.causal)


__all__ = [
    "AttentionBackend", "AttentionMetadata", "AttentionShape", "BACKENDS", "FLASHINFER_HEAD_DIMS", "check_non_causal_plan",
    "create_backend",
]
