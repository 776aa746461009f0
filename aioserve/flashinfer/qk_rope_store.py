"""q/k RMSNorm, RoPE and the KV write of an attention layer as one kernel.

Between the q|k|v projection and attention a Llama-family layer runs, on
FlashInfer's fused ops, a RoPE kernel and the KV write (and a Qwen3 layer
two RMSNorms before them, one for q and one for k): three or five launches
for a few kilobytes a token, where a batch-1 GPU step is bound by launches,
not bytes (kernel_census.py). FlashInfer has no kernel for this: its
`rope_quantize_fp8_append_paged_kv_cache` writes an FP8 cache and
quantises q, and its `fused_qk_rmsnorm_rope` rotates a video model's three
axes. So this one is aioserve's own, in Triton (which torch's CUDA builds
bring along): one program per token and head reads the head once, norms it
(Qwen3), rotates it (the "rotate half" form, from FlashInfer's cos|sin
cache), and writes q to a dense output, or k and that head's v into the
KV pool at the token's slot.

Taken (unless AIOSERVE_QK_ROPE_STORE=0) where its contract holds (contracts.qk_rope_store: half precision,
a KV pool of the same dtype, head_dim a power of two from 32 to 256, plain
RMSNorm or none), and only after a self-check on the device: the first time
a dtype, head_dim and norm meet, the kernel and the torch form
(`qk_rope_store_reference`) run on small random inputs and must agree,
else the layer keeps the separate kernels (logged once). The CPU tests run
the torch form through the same calls (tests/fake_flashinfer.py's stand-in,
which enforces the contract), and the GPU test compares the two on CUDA.

Its result differs from the separate kernels' by rounding only: the normed
head is rotated in float32 instead of being rounded to half in between.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

import torch

from aioserve.flashinfer import contracts
from aioserve.flashinfer.elementwise import MODEL_OPS, SelfCheckedOp
from aioserve.flashinfer.loader import OptionalModule

logger = logging.getLogger(__name__)

SELF_CHECK_TOLERANCE = 2e-2  # half precision: a rounding step of values around 1
# AIOSERVE_QK_ROPE_STORE=0 keeps the separate kernels (benchmarks/gpu_check.sh times both).
ENABLED = os.environ.get("AIOSERVE_QK_ROPE_STORE", "1") != "0"


def qk_rope_store_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor,
) -> torch.Tensor:
    """The torch form: q [T, Hq, D], k and v [T, Hk, D] (views are fine);
    `cos_sin` [P, D] float32, cos then sin (FlashInfer's cache); norm weights
    [D] or None (no q/k norm); caches [slots, Hk, D]. Writes k (normed,
    rotated) and v at `out_cache_loc`; returns q normed and rotated, dense."""
    half = q.shape[-1] // 2
    rows = cos_sin[positions]
    cos, sin = rows[:, None, :half], rows[:, None, half:]

    def prepared(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        if weight is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        first, second = x[..., :half], x[..., half:]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    k_cache[out_cache_loc] = prepared(k, k_weight).to(k_cache.dtype)
    v_cache[out_cache_loc] = v.to(v_cache.dtype)
    return prepared(q, q_weight).to(q.dtype)


# Triton comes with torch's CUDA builds (and with xgrammar), not everywhere: imported on first use.
KERNEL = OptionalModule(
    "triton", lambda: importlib.import_module("aioserve.flashinfer.qk_rope_store_triton"),
    "q/k norms, RoPE and the KV write stay separate kernels",
)


def load_kernel() -> Any:
    """The Triton kernel's module (its `qk_rope_store`), or None where Triton
    does not import; the CPU tests put a stand-in in KERNEL.module."""
    return KERNEL.load()


def self_check(kernels: Any, dtype: torch.dtype, head_dim: int, norm: bool, device: torch.device) -> str | None:
    """Why the kernel may not serve this dtype, head_dim and norm: it failed,
    or differed from the torch form on small random inputs; None when it agreed."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    tokens, hq, hk, slots = 5, 4, 2, 16
    qkv = rand(tokens, (hq + 2 * hk) * head_dim)  # q, k and v as views of one projection, as a layer has them
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k, v = q.view(tokens, hq, head_dim), k.view(tokens, hk, head_dim), v.view(tokens, hk, head_dim)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1).to(device)
    positions = torch.tensor([0, 3, 9, 40, 63], device=device)
    q_weight, k_weight = (rand(head_dim).abs() + 0.5, rand(head_dim).abs() + 0.5) if norm else (None, None)
    loc = torch.tensor([1, 7, 2, 15, 8], device=device)
    caches = [torch.zeros(slots, hk, head_dim, dtype=dtype, device=device) for _ in range(4)]
    try:
        fused_q = kernels.qk_rope_store(q, k, v, positions, cos_sin, q_weight, k_weight, 1e-6, caches[0], caches[1],
                                        loc)
    except Exception as exc:  # a compile or launch failure: the separate kernels serve
        return f"it failed its self-check ({type(exc).__name__}: {exc})"
    torch_q = qk_rope_store_reference(q, k, v, positions, cos_sin, q_weight, k_weight, 1e-6, caches[2], caches[3],
                                      loc)
    for name, fused, reference in (("q", fused_q, torch_q), ("k", caches[0], caches[2]), ("v", caches[1], caches[3])):
        error = (fused.float() - reference.float()).abs().max().item()
        if not error <= SELF_CHECK_TOLERANCE:
            return f"its {name} differed from the torch form by {error:.3g} in its self-check"
    return None


class QkRopeStoreOp(SelfCheckedOp):
    """The contract's decisions per layout, and the self-check's verdict per
    dtype, head_dim and norm (SelfCheckedOp)."""

    def __init__(self) -> None:
        super().__init__("qk_rope_store", contracts.qk_rope_store)

    def load(self) -> ModuleType | None:
        return load_kernel()

    def may_take(self, first: torch.Tensor) -> bool:
        return ENABLED and super().may_take(first)

    def verdict(self, kernels: Any, q: torch.Tensor, norm: bool) -> str | None:
        """Why the kernel may not serve this dtype, head_dim and norm, from its self-check, run once each."""
        key = (q.dtype, q.shape[-1], norm, str(q.device))
        return self.checked(key, lambda: self_check(kernels, q.dtype, q.shape[-1], norm, q.device),
                            f"head_dim {q.shape[-1]} ({q.dtype}{', q/k norms' if norm else ''})")


QK_ROPE_STORE = QkRopeStoreOp()
MODEL_OPS.append(QK_ROPE_STORE)  # reported once a layer asked for it
