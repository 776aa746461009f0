"""The Triton kernel of qk_rope_store.py (imported only there, lazily:
Triton comes with torch's CUDA builds, not its CPU ones). What it computes
and when it is taken: qk_rope_store.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, q_tok, q_head, k_tok, k_head, v_tok, v_head,
            pos_ptr, cs_ptr, cs_row, qw_ptr, kw_ptr, eps, out_ptr, kc_ptr, vc_ptr, c_slot, c_head, loc_ptr, HQ,
            HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """One program a token and head: heads 0..HQ-1 are q's (written to
    out, dense), the rest k's (written with v's same head to the pool at
    the token's slot)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * cs_row + offs)
    sin = tl.load(cs_ptr + pos * cs_row + HALF + offs)
    is_q = h < HQ
    kh = h - HQ
    if is_q:
        src = q_ptr + t * q_tok + h * q_head
        weight = qw_ptr
    else:
        src = k_ptr + t * k_tok + kh * k_head
        weight = kw_ptr
    first = tl.load(src + offs).to(tl.float32)
    second = tl.load(src + HALF + offs).to(tl.float32)
    if HAS_NORM:
        scale = tl.rsqrt((tl.sum(first * first, 0) + tl.sum(second * second, 0)) / (2 * HALF) + eps)
        first = first * scale * tl.load(weight + offs).to(tl.float32)
        second = second * scale * tl.load(weight + HALF + offs).to(tl.float32)
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    if is_q:
        dst = out_ptr + (t * HQ + h) * (2 * HALF)
        tl.store(dst + offs, rotated_first.to(out_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, rotated_second.to(out_ptr.dtype.element_ty))
    else:
        loc = tl.load(loc_ptr + t)
        dst = kc_ptr + loc * c_slot + kh * c_head
        tl.store(dst + offs, rotated_first.to(kc_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, rotated_second.to(kc_ptr.dtype.element_ty))
        v_src = v_ptr + t * v_tok + kh * v_head
        v_dst = vc_ptr + loc * c_slot + kh * c_head
        tl.store(v_dst + offs, tl.load(v_src + offs))
        tl.store(v_dst + HALF + offs, tl.load(v_src + HALF + offs))


def qk_rope_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor,
) -> torch.Tensor:
    """As qk_rope_store.qk_rope_store_reference, in one launch."""
    tokens, hq, d = q.shape
    out = torch.empty(tokens, hq, d, dtype=q.dtype, device=q.device)
    if tokens:
        norm = q_weight is not None and k_weight is not None
        _kernel[(tokens, hq + k.shape[1])](
            q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            positions, cos_sin, cos_sin.stride(0), q_weight if norm else q, k_weight if norm else k, eps,
            out, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), out_cache_loc, hq,
            HALF=d // 2, HAS_NORM=norm, num_warps=1,
        )
    return out
