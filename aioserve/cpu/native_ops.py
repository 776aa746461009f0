"""The elementwise and attention kernels (native/elementwise.cpp,
native/attention.cpp) for torch tensors: each checks its tensors as the
torch extension did (the same RuntimeError messages), allocates the outputs
and passes data pointers, sizes and strides to the library (native_lib.py)."""

from __future__ import annotations

import logging

import torch

from aioserve.cpu.native_lib import code, library

logger = logging.getLogger(__name__)

Rows = tuple[int, int, int, int]  # count, inner, outer stride, inner stride: native/kernels.h's Rows


def _has_rows(t: torch.Tensor) -> bool:
    return t.dim() in (2, 3) and t.stride(-1) == 1


def _rows_of(t: torch.Tensor) -> Rows:
    if t.dim() == 2:
        return (t.shape[0], 1, t.stride(0), 0)
    return (t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1))


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] (of x + residual, written to residual, when one is given)."""
    dim = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != dim or not weight.is_contiguous():
        raise RuntimeError("rms_norm: weight must be [D]")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out_dtype != x.dtype and out_dtype != torch.float32:
        raise RuntimeError("rms_norm: weight must have x's dtype or float32")
    # empty_like where it is contiguous anyway: ~2 us less than empty(shape) (the call's overhead is the cost at
    # a small model's sizes).
    out = torch.empty_like(x) if out_dtype == x.dtype and x.is_contiguous() else torch.empty(x.shape, dtype=out_dtype)
    if not _has_rows(x):
        x = x.contiguous().view(-1, dim)
    res_ptr, res_rows = 0, (0, 1, 0, 0)  # 0: a null pointer
    if residual is not None:
        if residual.dtype != x.dtype or residual.numel() != x.numel() or residual.shape[-1] != dim:
            raise RuntimeError("rms_norm: residual must match x")
        if not residual.is_contiguous():
            raise RuntimeError("rms_norm: the residual is updated in place, so it must be contiguous")
        res_ptr, res_rows = residual.data_ptr(), (residual.numel() // max(dim, 1), 1, dim, 0)
    lib = library()
    if lib.rms_norm(x.data_ptr(), *_rows_of(x), res_ptr, *res_rows, code(x, "rms_norm"), weight.data_ptr(),
                    code(weight, "rms_norm"), out.data_ptr(), dim, eps):
        raise lib.fail()
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> None:
    """RoPE (rotate half) on q [T, Hq, D] and k [T, Hk, D] in place."""
    if q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise RuntimeError("rotary_embedding: q [T, Hq, D] and k [T, Hk, D] with contiguous rows (rotated in place)")
    if q.dtype != k.dtype:
        raise RuntimeError("rotary_embedding: q and k must share a dtype")
    tokens, dim = q.shape[0], q.shape[2]
    if k.shape[0] != tokens or k.shape[2] != dim or dim % 2 != 0:
        raise RuntimeError("rotary_embedding: q and k shapes differ")
    if positions.dtype != torch.int64 or positions.numel() != tokens:
        raise RuntimeError("rotary_embedding: positions [T] int64")
    if (cos_cache.dtype != torch.float32 or sin_cache.dtype != torch.float32 or not cos_cache.is_contiguous()
            or not sin_cache.is_contiguous() or cos_cache.shape[1] != dim or sin_cache.shape != cos_cache.shape):
        raise RuntimeError("rotary_embedding: cos/sin caches [max_positions, D] float32")
    positions = positions.contiguous()
    lib = library()
    if lib.rotary_embedding(
        positions.data_ptr(), q.data_ptr(), q.shape[1], q.stride(0), q.stride(1), k.data_ptr(), k.shape[1], k.stride(0),
        k.stride(1), code(q, "rotary_embedding"), cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0],
        tokens, dim,
    ):
        raise lib.fail()


def store_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hk, D] into the caches' slots, converted to their dtype."""
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype:
        raise RuntimeError("store_kv: k, v [T, Hk, D]")
    if (key_cache.dim() != 3 or key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()):
        raise RuntimeError("store_kv: contiguous caches [slots, Hk, D] of one dtype")
    tokens, heads, dim = k.shape
    if key_cache.shape[1] != heads or key_cache.shape[2] != dim:
        raise RuntimeError("store_kv: k and the cache's rows differ")
    if slots.dtype != torch.int64 or slots.numel() != tokens:
        raise RuntimeError("store_kv: slots [T] int64")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slots = slots.contiguous()
    lib = library()
    if lib.store_kv(
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), code(k, "store_kv"),
        key_cache.data_ptr(), value_cache.data_ptr(), code(key_cache, "store_kv"), slots.data_ptr(),
        key_cache.shape[0], tokens, heads, dim,
    ):
        raise lib.fail()


_NO_NORM = -1  # native kNoNorm: a norm weight's type where there is none


def _norm_code(weight: torch.Tensor | None) -> int:
    return _NO_NORM if weight is None else code(weight, "qk_norm_rope_store")


def qk_norm_rope_store_fuses(q: torch.Tensor, key_cache: torch.Tensor, q_weight: torch.Tensor | None = None,
                             k_weight: torch.Tensor | None = None) -> bool:
    """Whether qk_norm_rope_store takes q's rows, this cache and these norm
    weights (None: no norms): bf16 or fp16 rows, a cache and weights of
    their dtype, head dim a multiple of 32 up to 256."""
    return q.dim() == 3 and bool(library().qk_norm_rope_store_fuses(
        code(q, "qk_norm_rope_store"), code(key_cache, "qk_norm_rope_store"), q.shape[2], _norm_code(q_weight),
        _norm_code(k_weight)))


def qk_norm_rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos_cache: torch.Tensor, sin_cache: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
    """rms_norm of q and k by their weights (both None: no norm),
    rotary_embedding, and store_kv of k and v, bit for bit, in one pass:
    returns q normed and rotated, dense [T, Hq, D]; k (a view, rows
    contiguous) is left normed and rotated in place, as attention over this
    step's prompt tokens reads it."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.dtype != k.dtype or k.dtype != v.dtype:
        raise RuntimeError("qk_norm_rope_store: q [T, Hq, D], k and v [T, Hk, D] of one dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise RuntimeError("qk_norm_rope_store: rows must be contiguous")
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != tokens or k.shape[2] != dim or q_heads % kv_heads:
        raise RuntimeError("qk_norm_rope_store: q and k shapes differ")
    if (q_weight is None) != (k_weight is None):
        raise RuntimeError("qk_norm_rope_store: both norm weights or neither")
    if not qk_norm_rope_store_fuses(q, key_cache, q_weight, k_weight):
        raise RuntimeError("qk_norm_rope_store: not for these rows, cache and norm weights "
                           "(see qk_norm_rope_store_fuses)")
    if (key_cache.dim() != 3 or key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype
            or key_cache.shape[1:] != (kv_heads, dim) or not key_cache.is_contiguous()
            or not value_cache.is_contiguous()):
        raise RuntimeError("qk_norm_rope_store: contiguous caches [slots, Hk, D] of the rows' dtype")
    if (cos_cache.dtype != torch.float32 or sin_cache.dtype != torch.float32 or not cos_cache.is_contiguous()
            or not sin_cache.is_contiguous() or cos_cache.shape[1] != dim or sin_cache.shape != cos_cache.shape):
        raise RuntimeError("qk_norm_rope_store: cos/sin caches [max_positions, D] float32")
    for weight in (q_weight, k_weight):
        if weight is not None and (weight.shape != (dim,) or not weight.is_contiguous()):
            raise RuntimeError("qk_norm_rope_store: contiguous norm weights [D]")
    if positions.dtype != torch.int64 or positions.numel() != tokens or slots.dtype != torch.int64 \
            or slots.numel() != tokens:
        raise RuntimeError("qk_norm_rope_store: positions and slots [T] int64")
    positions, slots = positions.contiguous(), slots.contiguous()
    out = torch.empty(tokens, q_heads, dim, dtype=q.dtype)
    if tokens == 0:
        return out
    lib = library()
    if lib.qk_norm_rope_store(
        positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), code(q, "qk_norm_rope_store"),
        q_weight.data_ptr() if q_weight is not None else 0, _norm_code(q_weight),
        k_weight.data_ptr() if k_weight is not None else 0, _norm_code(k_weight), eps,
        cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0], key_cache.data_ptr(), value_cache.data_ptr(),
        code(key_cache, "qk_norm_rope_store"), slots.data_ptr(), key_cache.shape[0], tokens, q_heads, kv_heads, dim,
        out.data_ptr(),
    ):
        raise lib.fail()
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :N]) * x[..., N:]."""
    width = x.shape[-1]
    if width % 2 != 0:
        raise RuntimeError("silu_and_mul: the last dim must be [gate | up]")
    out = (torch.empty(x.shape[0], width // 2, dtype=x.dtype) if x.dim() == 2
           else torch.empty((*x.shape[:-1], width // 2), dtype=x.dtype))
    x = x.contiguous()
    lib = library()
    if lib.silu_and_mul(x.data_ptr(), out.data_ptr(), code(x, "silu_and_mul"), x.numel() // max(1, width), width // 2):
        raise lib.fail()
    return out


def row_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first argmax) of each row of float32 logits [S, V]."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] <= 0:
        raise RuntimeError("row_max_argmax: logits [S, V > 0] float32")
    logits = logits.contiguous()
    rows = logits.shape[0]
    maxes = torch.empty(rows, dtype=torch.float32)
    argmaxes = torch.empty(rows, dtype=torch.int64)  # (positional sizes: the fastest form of empty)
    lib = library()
    if lib.row_max_argmax(logits.data_ptr(), rows, logits.shape[1], maxes.data_ptr(), argmaxes.data_ptr()):
        raise lib.fail()
    return maxes, argmaxes


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, page_size: int, scale: float, window: int) -> torch.Tensor:
    """Decode attention over paged KV (CPU): q [B, H, D], caches [slots, Hk, D]."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise RuntimeError("q [B,H,D], caches [slots,Hk,D]")
    if k_cache.dtype != v_cache.dtype:
        raise RuntimeError("the K and V caches must share a dtype")
    if q.dtype != k_cache.dtype and q.dtype != torch.float32 and k_cache.dtype != torch.float8_e4m3fn:
        raise RuntimeError("q must have the caches' dtype, or be float32 (any q over an FP8 cache)")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise RuntimeError("caches must be contiguous")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int64:
        raise RuntimeError("page_table int32, seq_lens int64")
    if q.shape[1] % k_cache.shape[1] != 0:
        raise RuntimeError("query heads must be a multiple of KV heads")
    q = q.contiguous()
    page_table = page_table.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    lib = library()
    if lib.paged_decode_attention(
        q.data_ptr(), code(q, "paged_decode_attention"), k_cache.data_ptr(), v_cache.data_ptr(),
        code(k_cache, "paged_decode_attention"), page_table.data_ptr(), page_table.shape[1], seq_lens.data_ptr(),
        batch, heads, k_cache.shape[1], dim, page_size, scale, window, out.data_ptr(),
    ):
        raise lib.fail()
    return out


def prefill_tiles_ready() -> bool:
    """Whether causal_prefill_attention runs here: the library built with
    AMX tiles (native/prefill_attention.cpp) and the tiles in use (the CPU
    has them, Linux permits them, AIOSERVE_AMX is not 0)."""
    lib = library()
    return lib.prefill_tiles_built and lib.tiles_in_use()


def prefill_f32_ready() -> bool:
    """Whether causal_prefill_attention takes float32 here: the library
    built with AVX-512 (native/prefill_attention_f32.cpp)."""
    return library().prefill_f32_built


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                             out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of `count` requests' chunks of equal length: bf16 on
    AMX tiles (D a multiple of 32 up to 256), float32 on AVX-512 FMAs (D a
    multiple of 16 up to 256). q [count * q_len, H, D], k and v [count *
    kv_len, Hk, D] (views are fine: the last dim contiguous); query i of a
    chunk sits at i + kv_len - q_len and sees the keys up to it (with a
    `window`, none `window` or more behind it: Gemma 3's local layers).
    Returns [count * q_len, H, D] in q's dtype, contiguous (`out`, if given:
    written in place)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise RuntimeError("causal_prefill_attention: q [T, H, D], k and v [T', Hk, D]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float32):
        raise RuntimeError("causal_prefill_attention: bf16 or float32 q, k and v, all one dtype")
    if any(t.stride(2) != 1 for t in (q, k, v)):
        raise RuntimeError("causal_prefill_attention: the last dim of q, k and v must be contiguous")
    if count <= 0 or q.shape[0] % count or k.shape[0] % count:
        raise RuntimeError(f"causal_prefill_attention: {q.shape[0]} query and {k.shape[0]} key rows over {count} requests")
    q_len, kv_len = q.shape[0] // count, k.shape[0] // count
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if out is None:
        out = torch.empty(q.shape[0], heads, dim, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise RuntimeError("causal_prefill_attention: out must be contiguous, of q's shape and dtype")
    lib = library()
    kernel = lib.causal_prefill_attention if q.dtype == torch.bfloat16 else lib.causal_prefill_attention_f32
    if kernel(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), count, q_len, kv_len, heads, kv_heads, dim, scale, window or 0, out.data_ptr(),
    ):
        raise lib.fail()
    return out
