"""What each FlashInfer kernel aioserve calls requires of its arguments, in one place.

A CUDA kernel does not check its inputs: handed a pointer 8 bytes off the
16-byte boundary its vector loads need, it faults with "misaligned address",
and the error is sticky (every later CUDA call of the process fails, far
from its cause). So every call site asks the matching function here first,
once per input layout (elementwise.py), and takes the
torch form when the answer is a reason instead of None.

The contracts, read off FlashInfer's kernels (include/flashinfer/*.cuh) and
their bindings (csrc/*.cu):

| entry point | dtypes | layout | alignment (bytes) | shapes |
|---|---|---|---|---|
| norm.rmsnorm | x, weight: one half type | 2-D rows or 3-D [T, H, D], last dim contiguous | data and row/head strides: multiples of V = gcd(16 / itemsize, D) * itemsize | weight [D] |
| norm.fused_add_rmsnorm | x, residual, weight: one half type | 2-D, last dim contiguous | as rmsnorm, for x and residual | same shape |
| activation.silu_and_mul | one half type | contiguous (rows are read at token * 2d) | data 16; d * itemsize % 16 (the up half and each output row start at a multiple of d) | last dim even |
| rope.apply_rope_with_cos_sin_cache_inplace | q, k: one half type; cache float32; positions int32/int64 | q, k 3-D, last dim contiguous; cache and positions contiguous | q, k data and strides 16 | head_dim in 64/128/256/512 (the specialised kernel; other head dims take a different path), cache [P, head_dim] |
| Batch{Decode,Prefill}WithPagedKVCacheWrapper | q: float16/bfloat16; cache: the same or float8_e4m3fn | q [T, Hq, D] contiguous; cache NHD [pages, page_size, Hk, D] | data 16 | head_dim in 64/128/256; plan arrays int32; a prefill's custom_mask (rows that attend both ways) flat bool of every request's [qo_len, kv_len], with causal off |
| fused_moe.cutlass_fused_moe | x, fc1, fc2: one half type; expert ids int32; routing weights float32 | all contiguous: x [T, H], ids and weights [T, k], fc1 [E, 2I, H] ([up, gate] rows), fc2 [E, H, I] | data 16 (rows 16 follow from the shapes) | H and I multiples of 128 (stricter than the 16-byte rows the kernel needs: its tile shapes cannot be checked here); compute capability 9.x on CUDA (the bundle's sm_90) |

| qk_rope_store (aioserve's own, Triton: flashinfer/qk_rope_store.py) | q, k, v, KV pool, norm weights: one half type; cache float32; positions int32/int64; slots int64 | q, k, v 3-D, last dim contiguous; pool [slots, Hk, D] contiguous; cache, positions, slots contiguous | none (Triton specialises on alignment) | head_dim in 32/64/128/256; norm weights [D] or none |
| gate_up_silu (aioserve's own, Triton: flashinfer/gate_up_silu.py) | x, weight: one half type | x [M, K], last dim contiguous; weight [2N, K] contiguous | none (Triton specialises on alignment) | 1 <= M <= 16 (one tl.dot tile); N >= 16 |

KV append (where qk_rope_store is not taken) and sampling are torch ops in aioserve (kvcache/kv_pool.py,
engine/sampler.py), not FlashInfer calls, so they have no contract here.
tests/fake_flashinfer.py models what the real kernels would do with a
violation (it raises), independently of these functions, so a contract
written too loosely here fails the CPU tests.
"""

from __future__ import annotations

from math import gcd

import torch

ALIGNMENT = 16  # bytes: the widest vector load or store these kernels issue
HALF = (torch.float16, torch.bfloat16)
FP8_KV = torch.float8_e4m3fn  # a KV cache the paged wrappers read with kv_data_type (q stays half)
ROPE_HEAD_DIMS = (64, 128, 256, 512)
PAGED_HEAD_DIMS = (64, 128, 256)
INDEX_DTYPE = torch.int32  # the paged wrappers' indptr / indices / last_page_len
POSITION_DTYPES = (torch.int32, torch.int64)
MOE_DIM_MULTIPLE = 128  # hidden and per-rank intermediate sizes the fused MoE kernel is admitted for
MOE_CAPABILITY_MAJOR = 9  # sm_90: the only architecture the project's GPU bundle builds for


def _misaligned(name: str, t: torch.Tensor, bytes_: int, dims: tuple[int, ...]) -> str | None:
    """Why `t`'s data pointer, or its stride along one of `dims`, is not a
    multiple of `bytes_`; None when all are."""
    if t.data_ptr() % bytes_:
        return f"{name}'s data starts {t.data_ptr() % bytes_} bytes off a {bytes_}-byte boundary"
    for dim in dims:
        if t.shape[dim] > 1 and (t.stride(dim) * t.element_size()) % bytes_:
            return f"{name}'s stride along dim {dim} ({t.stride(dim) * t.element_size()} bytes) is not a multiple of {bytes_}"
    return None


def _half(*named: tuple[str, torch.Tensor]) -> str | None:
    dtype = named[0][1].dtype
    if dtype not in HALF:
        return f"{named[0][0]} is {dtype}, the kernel takes float16/bfloat16"
    for name, t in named[1:]:
        if t.dtype != dtype:
            return f"{name} is {t.dtype}, not {dtype} like {named[0][0]}"
    return None


def _same_device(*tensors: torch.Tensor) -> str | None:
    devices = {t.device for t in tensors}
    return None if len(devices) == 1 else f"inputs on several devices {sorted(map(str, devices))}"


def norm_vector_bytes(d: int, itemsize: int) -> int:
    """The width of RMSNorm's loads: gcd(16 / itemsize, d) elements."""
    return gcd(ALIGNMENT // itemsize, d) * itemsize


def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """norm.rmsnorm(x, weight) over the last dim of a 2-D or 3-D x."""
    if x.dim() not in (2, 3):
        return f"x is {x.dim()}-D, the kernel takes 2-D rows or 3-D [tokens, heads, dim]"
    why = _half(("x", x), ("weight", weight)) or _same_device(x, weight)
    if why:
        return why
    if x.stride(-1) != 1 or not weight.is_contiguous():
        return "the last dim of x (and weight) must be contiguous"
    if weight.shape != (x.shape[-1],):
        return f"weight {tuple(weight.shape)} does not match the last dim {x.shape[-1]}"
    vector = norm_vector_bytes(x.shape[-1], x.element_size())
    return _misaligned("x", x, vector, tuple(range(x.dim() - 1))) or _misaligned("weight", weight, vector, ())


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> str | None:
    """norm.fused_add_rmsnorm(x, residual, weight): residual += x; x = norm(residual), in place."""
    if x.dim() != 2 or residual.shape != x.shape:
        return f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be one 2-D shape"
    why = rmsnorm(x, weight) or _half(("x", x), ("residual", residual)) or _same_device(x, residual)
    if why:
        return why
    if residual.stride(-1) != 1:
        return "the last dim of residual must be contiguous"
    return _misaligned("residual", residual, norm_vector_bytes(x.shape[-1], x.element_size()), (0,))


def silu_and_mul(x: torch.Tensor) -> str | None:
    """activation.silu_and_mul(x): silu(x[..., :d]) * x[..., d:]."""
    return _gated_activation(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> str | None:
    """activation.gelu_tanh_and_mul(x): gelu_tanh(x[..., :d]) * x[..., d:]
    (Gemma's GeGLU): the same act-and-mul kernel as SiLU's, another function."""
    return _gated_activation(x)


def _gated_activation(x: torch.Tensor) -> str | None:
    """What FlashInfer's act_and_mul kernel needs: 16-byte vector loads of
    both halves of each contiguous row."""
    why = _half(("x", x))
    if why:
        return why
    if x.shape[-1] % 2:
        return f"the last dim {x.shape[-1]} is odd"
    if not x.is_contiguous():
        return "x must be contiguous (the kernel reads row t at t * 2d)"
    d_bytes = x.shape[-1] // 2 * x.element_size()
    if d_bytes % ALIGNMENT:
        return (f"the up half starts {d_bytes} bytes into each row, not a multiple of {ALIGNMENT} "
                f"(intermediate size {x.shape[-1] // 2})")
    return _misaligned("x", x, ALIGNMENT, ())


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> str | None:
    """rope.apply_rope_with_cos_sin_cache_inplace over q [T, Hq, D] and k [T, Hk, D]."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [tokens, heads, head_dim] alike"
    head_dim = q.shape[2]
    if head_dim not in ROPE_HEAD_DIMS:
        return f"head_dim {head_dim} is not one its RoPE kernel is built for {ROPE_HEAD_DIMS}"
    why = _half(("q", q), ("k", k)) or _same_device(q, k, positions, cos_sin_cache)
    if why:
        return why
    if positions.dtype not in POSITION_DTYPES or positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        return f"positions must be int32/int64 [tokens], not {positions.dtype} {tuple(positions.shape)}"
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        return f"the cos/sin cache must be float32 [positions, {head_dim}]"
    if not (cos_sin_cache.is_contiguous() and positions.is_contiguous()):
        return "the cos/sin cache and positions must be contiguous"
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "the last dim of q and k must be contiguous"
    return _misaligned("q", q, ALIGNMENT, (0, 1)) or _misaligned("k", k, ALIGNMENT, (0, 1))


QK_ROPE_STORE_HEAD_DIMS = (32, 64, 128, 256)  # its halves are one Triton block each: powers of two


def qk_rope_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor, *weights: torch.Tensor,
) -> str | None:
    """aioserve's own qk_rope_store (flashinfer/qk_rope_store.py): q [T, Hq, D]
    and k, v [T, Hk, D] with a contiguous last dim (views into the projection
    are fine); a KV pool [slots, Hk, D] of q's dtype; FlashInfer's float32
    cos|sin cache; optionally the q and k norm weights [D]."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be [tokens, heads, head_dim] alike"
    head_dim = q.shape[2]
    if head_dim not in QK_ROPE_STORE_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {QK_ROPE_STORE_HEAD_DIMS}"
    why = (_half(("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), *(("norm weight", w) for w in weights))
           or _same_device(q, k, v, positions, cos_sin, k_cache, v_cache, out_cache_loc, *weights))
    if why:
        return why
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "the last dim of q, k and v must be contiguous"
    if k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return f"the KV pool must be contiguous [slots, {k.shape[1]}, {head_dim}]"
    if positions.dtype not in POSITION_DTYPES or positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        return f"positions must be int32/int64 [tokens], not {positions.dtype} {tuple(positions.shape)}"
    if out_cache_loc.dtype != torch.int64 or out_cache_loc.shape != positions.shape:
        return "the KV slots must be int64 [tokens]"
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        return f"the cos/sin cache must be float32 [positions, {head_dim}]"
    if not (cos_sin.is_contiguous() and positions.is_contiguous() and out_cache_loc.is_contiguous()):
        return "the cos/sin cache, positions and KV slots must be contiguous"
    if any(w.shape != (head_dim,) or not w.is_contiguous() for w in weights):
        return f"the norm weights must be contiguous [{head_dim}]"
    return None


GATE_UP_SILU_MAX_ROWS = 16  # rows of one tl.dot tile
GATE_UP_SILU_MIN_COLUMNS = 16  # the narrowest column block


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """aioserve's own gate_up_silu (flashinfer/gate_up_silu.py): x [M, K]
    with a contiguous last dim and 1 <= M <= 16 rows; the fused projection's
    weight [2N, K] ([gate | up] rows), contiguous, of x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % 2:
        return f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [2N, K]"
    if not 1 <= x.shape[0] <= GATE_UP_SILU_MAX_ROWS:
        return f"{x.shape[0]} rows: the kernel takes 1 to {GATE_UP_SILU_MAX_ROWS} (one tile)"
    if weight.shape[0] // 2 < GATE_UP_SILU_MIN_COLUMNS:
        return f"{weight.shape[0] // 2} output columns, fewer than one block of {GATE_UP_SILU_MIN_COLUMNS}"
    why = _half(("x", x), ("weight", weight)) or _same_device(x, weight)
    if why:
        return why
    if x.stride(1) != 1 or not weight.is_contiguous():
        return "x's last dim and the weight must be contiguous"
    return None


def paged_attention(head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """The paged decode/prefill wrappers for a model: decided once, when the backend is chosen."""
    if q_dtype not in HALF or kv_dtype not in (*HALF, FP8_KV):
        return f"its kernels take float16/bfloat16 (an e4m3 cache too), not {q_dtype} math over a {kv_dtype} cache"
    if head_dim not in PAGED_HEAD_DIMS:
        return f"its kernels take head dims {PAGED_HEAD_DIMS}, not {head_dim}"
    return None


def paged_plan_arrays(*arrays: torch.Tensor) -> str | None:
    """indptr / indices / last_page_len (and qo_indptr) handed to `plan`."""
    for t in arrays:
        if t.dtype != INDEX_DTYPE or not t.is_contiguous():
            return f"plan arrays must be contiguous {INDEX_DTYPE}, not {t.dtype}"
    return None


def fused_moe(
    x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor
) -> str | None:
    """fused_moe.cutlass_fused_moe(x, expert_ids, routing_weights, fc1, fc2, ...)
    unquantised, on weights already sharded per rank (tp_size 1)."""
    if x.dim() != 2 or fc1.dim() != 3 or fc2.dim() != 3:
        return f"x {tuple(x.shape)}, fc1 {tuple(fc1.shape)} and fc2 {tuple(fc2.shape)} must be 2-D, 3-D, 3-D"
    experts, hidden, intermediate = fc2.shape
    if tuple(fc1.shape) != (experts, 2 * intermediate, hidden) or x.shape[1] != hidden:
        return f"x {tuple(x.shape)}, fc1 {tuple(fc1.shape)} and fc2 {tuple(fc2.shape)} do not agree on [E, 2I, H], [E, H, I]"
    if x.shape[0] == 0:
        return "no tokens"
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or routing_weights.shape != expert_ids.shape:
        return f"expert ids {tuple(expert_ids.shape)} and routing weights {tuple(routing_weights.shape)} must be [tokens, k]"
    why = _half(("x", x), ("fc1", fc1), ("fc2", fc2)) or _same_device(x, expert_ids, routing_weights, fc1, fc2)
    if why:
        return why
    if expert_ids.dtype != INDEX_DTYPE or routing_weights.dtype != torch.float32:
        return f"expert ids must be int32 and routing weights float32, not {expert_ids.dtype} and {routing_weights.dtype}"
    for name, t in (("x", x), ("expert ids", expert_ids), ("routing weights", routing_weights), ("fc1", fc1), ("fc2", fc2)):
        if not t.is_contiguous():
            return f"{name} must be contiguous"
    if hidden % MOE_DIM_MULTIPLE or intermediate % MOE_DIM_MULTIPLE:
        return (f"hidden size {hidden} and per-rank expert intermediate size {intermediate} must be multiples of "
                f"{MOE_DIM_MULTIPLE}")
    if x.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(x.device)
        if major != MOE_CAPABILITY_MAJOR:
            return f"compute capability {major}.{minor}: the kernel is admitted on sm_90 only"
    return _misaligned("x", x, ALIGNMENT, ()) or _misaligned("fc1", fc1, ALIGNMENT, ()) or _misaligned(
        "fc2", fc2, ALIGNMENT, ())
