"""A stand-in for the FlashInfer entry points aioserve uses, in plain torch
on CPU, read off FlashInfer's documented semantics: paged KV described by
(indptr, indices, last_page_len), queries by qo_indptr, causal attention
aligned to the end of each request's KV (or, planned with causal=False, each
query attending to all of its request's KV), `window_left` inclusive, NHD
layout, and CUDA-graph mode planning into caller-owned buffers that `run`
reads back; the fused RMSNorm, RoPE and SiLU-and-mul; the CUTLASS fused MoE
(fc1 rows [up | gate], silu of the second half times the first, the
routing weights applied when the k expert outputs are summed).

It also models what the real kernels do with memory, and raises
`KernelFault` where they would fault or read the wrong bytes: a vector load
or store off its alignment (computed address by address from the kernels'
own loop: RMSNorm loads gcd(16 / itemsize, d) elements at a time, SiLU-and-mul
and RoPE 16 bytes), a layout the kernel indexes as if it were dense, a head
dim no kernel is built for, a wrong index dtype. These checks are written
from the kernels, not from aioserve/flashinfer/contracts.py, so a contract
written too loosely there fails here. One liberty: the wrappers accept
float32 so the CPU tests can compare them token for token with the float32
torch reference (the real ones refuse it with a Python error, and
flashinfer/contracts.py, paged_attention, keeps float32 away from them).
With it the FlashInfer backend's planning, row routing and graph buffers,
and the layers' fused-op choices, run on CPU; the real kernels are tested
on a GPU (tests/test_gpu_fast_path.py).
"""

from __future__ import annotations

from math import gcd
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)
ROPE_KERNEL_HEAD_DIMS = (64, 128, 256, 512)  # DISPATCH_HEAD_DIM of the cos/sin-cache RoPE kernel
PAGED_KERNEL_HEAD_DIMS = (64, 128, 256)


class KernelFault(RuntimeError):
    """What the real kernel would do instead: `CUDA error: misaligned address`,
    or read the wrong bytes, or find no kernel for the shape."""


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise KernelFault(message)


def _vector_loads(name: str, t: torch.Tensor, offsets: torch.Tensor, vector_bytes: int) -> None:
    """Every address a kernel loads or stores a `vector_bytes` vector at:
    t's data pointer plus `offsets` elements."""
    addresses = t.data_ptr() + offsets.long() * t.element_size()
    bad = addresses % vector_bytes != 0
    if bool(bad.any()):
        first = int(offsets.flatten()[bad.flatten()][0])
        raise KernelFault(f"misaligned address: {vector_bytes}-byte access to {name} at element offset {first}")


def _row_starts(t: torch.Tensor) -> torch.Tensor:
    """The element offset of every row (every index but the last) of t."""
    grids = torch.meshgrid(*[torch.arange(n) for n in t.shape[:-1]], indexing="ij")
    starts = torch.zeros(t.shape[:-1], dtype=torch.long)
    for dim, grid in enumerate(grids):
        starts += grid * t.stride(dim)
    return starts.flatten()


def _vectors_of_rows(t: torch.Tensor, d: int, vector: int, start: int = 0) -> torch.Tensor:
    """Offsets of the vectors a kernel reads across `d` elements from `start` in each row."""
    return (_row_starts(t)[:, None] + start + torch.arange(0, d - d % vector, vector)[None, :]).flatten()


def _half_only(*tensors: torch.Tensor) -> None:
    _need(tensors[0].dtype in HALF, f"no kernel for {tensors[0].dtype} (float16/bfloat16 only)")
    _need(all(t.dtype == tensors[0].dtype for t in tensors), "inputs of mixed dtypes are read as the first's type")


def _attend(q, k_cache, v_cache, qo_indptr, indptr, indices, last_page_len, scale, window_left, out, causal=True,
            custom_mask=None):
    page_size, hk = k_cache.shape[1], k_cache.shape[2]

    def _kv_len(j):
        return (int(indptr[j + 1] - indptr[j]) - 1) * page_size + int(last_page_len[j])

    k_flat, v_flat = k_cache.reshape(-1, hk, k_cache.shape[3]), v_cache.reshape(-1, hk, v_cache.shape[3])
    for i in range(last_page_len.shape[0]):
        pages = indices[indptr[i] : indptr[i + 1]].long()
        length = (pages.shape[0] - 1) * page_size + int(last_page_len[i])
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:length]
        rows = slice(int(qo_indptr[i]), int(qo_indptr[i + 1]))
        queries = q[rows]
        k = k_flat[slots].to(q.dtype).repeat_interleave(q.shape[1] // hk, dim=1)
        v = v_flat[slots].to(q.dtype).repeat_interleave(q.shape[1] // hk, dim=1)
        q_pos = torch.arange(queries.shape[0])[:, None] + length - queries.shape[0]
        k_pos = torch.arange(length)[None, :]
        allowed = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
        if custom_mask is not None:  # each request's [qo_len, kv_len], flattened, one after another
            first = sum(int(qo_indptr[j + 1] - qo_indptr[j]) * _kv_len(j) for j in range(i))
            allowed = custom_mask[first : first + queries.shape[0] * length].view(queries.shape[0], length).cpu()
        if window_left >= 0:
            allowed &= k_pos >= q_pos - window_left
        out[rows] = F.scaled_dot_product_attention(
            queries.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
        ).transpose(0, 1)
    return out


class _Wrapper:
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, **buffers):
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.buffers = buffers
        self.planned = None
        self.plans = 0

    def _store(self, name, value):
        """Graph mode: into the fixed buffer (what a replay reads), else kept as given."""
        if not self.graph:
            return value
        buffer = self.buffers[name]
        buffer[: value.shape[0]].copy_(value)
        return buffer

    @staticmethod
    def _check_plan(head_dim, *arrays):
        _need(head_dim in PAGED_KERNEL_HEAD_DIMS, f"no paged attention kernel for head_dim {head_dim}")
        for array in arrays:
            _need(array.dtype == torch.int32, f"plan arrays are read as int32, got {array.dtype}")
            _need(array.is_contiguous(), "plan arrays are read densely")

    def _run(self, q, paged_kv_cache, out, window_left, qo_indptr):
        p = self.planned
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (p.page_size, p.num_kv_heads, p.head_dim) and q.shape[1] == p.num_qo_heads
        assert q.dtype == p.q_data_type and k_cache.dtype == p.kv_data_type
        for name, t in (("q", q), ("out", out)):
            if t is not None and t.numel():
                _need(t.stride(-1) == 1, f"{name}'s last dim is read densely")
                _vector_loads(name, t, _row_starts(t), 16)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):  # too many rows to list: pointer and strides
            _need(t.stride(-1) == 1, f"{name}'s last dim is read densely")
            _vector_loads(name, t, torch.tensor([0, *t.stride()[:-1]]), 16)
        out = torch.empty_like(q) if out is None else out
        window = p.window_left if window_left is None else window_left
        # FlashInfer's run asserts this (decode.py and prefill.py): the window
        # picks the kernel at plan time, so a layer with another window needs
        # a wrapper planned with it.
        _need(window == p.window_left, f"run with window_left={window}, planned with {p.window_left}")
        return _attend(q, k_cache, v_cache, qo_indptr, p.indptr, p.indices, p.last_page_len, p.sm_scale, window, out,
                       getattr(p, "causal", True), getattr(p, "custom_mask", None))


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        super().__init__(workspace, kv_layout, use_cuda_graph, indptr=paged_kv_indptr_buffer,
                         indices=paged_kv_indices_buffer, last_page_len=paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left=-1, q_data_type=torch.float16, kv_data_type=None, sm_scale=None):
        assert indptr.device.type == "cpu", "plan takes host arrays"
        if self.graph:
            assert last_page_len.shape[0] == self.buffers["last_page_len"].shape[0], "a graph wrapper's batch is fixed"
        self._check_plan(head_dim, indptr, indices, last_page_len)
        self.plans += 1
        self.planned = SimpleNamespace(
            indptr=self._store("indptr", indptr), indices=self._store("indices", indices),
            last_page_len=self._store("last_page_len", last_page_len), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, window_left=window_left,
            q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type, sm_scale=sm_scale or head_dim**-0.5,
        )

    def run(self, q, paged_kv_cache, *, out=None, window_left=None):
        batch = self.planned.last_page_len.shape[0]
        assert q.shape[0] == batch, "one query per planned request"
        return self._run(q, paged_kv_cache, out, window_left, torch.arange(batch + 1))


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None):
        super().__init__(workspace, kv_layout, use_cuda_graph, qo_indptr=qo_indptr_buf, indptr=paged_kv_indptr_buf,
                         indices=paged_kv_indices_buf, last_page_len=paged_kv_last_page_len_buf)
        if use_cuda_graph:  # FlashInfer's own checks at construction (prefill.py)
            assert all(torch.is_tensor(b) for b in self.buffers.values()), "graph mode needs every buffer"
            batch = qo_indptr_buf.shape[0] - 1
            assert paged_kv_indptr_buf.shape[0] == batch + 1 and paged_kv_last_page_len_buf.shape[0] == batch
        self.max_total_rows = None  # graph mode: the first plan's rows (the capture's), never exceeded

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, window_left=-1, q_data_type=torch.float16,
             kv_data_type=None, sm_scale=None, custom_mask=None):
        assert qo_indptr.device.type == "cpu", "plan takes host arrays"
        self._check_plan(head_dim_qk, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        if self.graph:  # FlashInfer's graph-mode rules (prefill.py's plan)
            rows = int(qo_indptr[-1])
            self.max_total_rows = rows if self.max_total_rows is None else self.max_total_rows
            _need(rows <= self.max_total_rows, f"{rows} rows exceed the {self.max_total_rows} a graph was planned with")
            _need(qo_indptr.shape[0] == self.buffers["qo_indptr"].shape[0], "a graph wrapper's batch size is fixed")
            _need(paged_kv_indices.shape[0] <= self.buffers["indices"].shape[0], "paged_kv_indices exceed the buffer")
            _need(custom_mask is None, "aioserve plans no custom mask in graph mode")
        if custom_mask is not None:  # FlashInfer packs it into bits per request: a flat bool of every [qo, kv]
            _need(custom_mask.dtype == torch.bool and custom_mask.dim() == 1, "custom_mask is a flat bool tensor")
            qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
            kv_lens = [(int(paged_kv_indptr[j + 1] - paged_kv_indptr[j]) - 1) * page_size
                       + int(paged_kv_last_page_len[j]) for j in range(len(qo_lens))]
            _need(custom_mask.numel() == sum(q * k for q, k in zip(qo_lens, kv_lens)),
                  "custom_mask holds every request's [qo_len, kv_len]")
            _need(not causal, "a custom mask replaces the causal one")
        self.plans += 1
        self.planned = SimpleNamespace(
            qo_indptr=self._store("qo_indptr", qo_indptr), indptr=self._store("indptr", paged_kv_indptr),
            indices=self._store("indices", paged_kv_indices),
            last_page_len=self._store("last_page_len", paged_kv_last_page_len), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk, page_size=page_size, window_left=window_left, q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type, sm_scale=sm_scale or head_dim_qk**-0.5, causal=causal,
            custom_mask=custom_mask,
        )

    def run(self, q, paged_kv_cache, *, out=None, window_left=None):
        planned_rows = int(self.planned.qo_indptr[-1])
        if not self.graph:
            assert q.shape[0] == planned_rows, "one query per planned token"
            return self._run(q, paged_kv_cache, out, window_left, self.planned.qo_indptr)
        # A replay runs the capture's rows; a plan naming fewer leaves the
        # rest unwritten (garbage on a GPU, NaN here, so that a use shows).
        _need(q.shape[0] == self.max_total_rows, "a graph replays the rows it was captured with")
        out = self._run(q, paged_kv_cache, out, window_left, self.planned.qo_indptr)
        out[planned_rows:] = float("nan")
        return out


fake_flashinfer = SimpleNamespace(
    BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
)


# -- the fused elementwise ops (flashinfer.norm / rope / activation) ----------------


def _norm_vector_bytes(x: torch.Tensor) -> int:
    return gcd(16 // x.element_size(), x.shape[-1]) * x.element_size()  # RMSNorm's VEC_SIZE, in bytes


def _check_norm(x, weight, *others):
    _half_only(x, weight, *others)
    _need(x.dim() in (2, 3), f"no norm kernel for {x.dim()}-D input")
    vector = _norm_vector_bytes(x)
    for name, t in (("input", x), *((f"residual", o) for o in others)):
        _need(t.stride(-1) == 1, f"{name}'s last dim is read densely")
        _vector_loads(name, t, _vectors_of_rows(t, t.shape[-1], vector // t.element_size()), vector)
    _vector_loads("weight", weight, torch.arange(0, x.shape[-1], vector // x.element_size()), vector)


def _rmsnorm_math(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _rmsnorm(x, weight, eps=1e-6, out=None):
    _check_norm(x, weight)
    if out is None:
        return _rmsnorm_math(x, weight, eps)
    # The kernel writes rows through out's own strides (3-D: stride(0) and stride(1)).
    _need(out.shape == x.shape and out.dtype == x.dtype, "out has the input's shape and dtype")
    _check_norm(out, weight)
    out.copy_(_rmsnorm_math(x, weight, eps))
    return out


def _fused_add_rmsnorm(x, residual, weight, eps=1e-6):
    _need(x.dim() == 2, "fused_add_rmsnorm takes 2-D rows")
    _check_norm(x, weight, residual)
    residual.add_(x)  # residual += input, then input = norm(residual)
    x.copy_(_rmsnorm_math(residual, weight, eps))


def _apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    assert is_neox
    _need(cos_sin_cache.dtype == torch.float32, "cos_sin_cache should be float32")
    _need(positions.dtype in (torch.int32, torch.int64), f"positions are read as int32/int64, got {positions.dtype}")
    _need(head_size in ROPE_KERNEL_HEAD_DIMS, f"no RoPE kernel specialised for head_dim {head_size}")
    _half_only(query, key)
    q, k = query.view(query.shape[0], -1, head_size), key.view(key.shape[0], -1, head_size)
    for name, t in (("query", q), ("key", k)):
        _vector_loads(name, t, _vectors_of_rows(t, head_size, 16 // t.element_size()), 16)
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions, :half][:, None, :], cos_sin_cache[positions, half:][:, None, :]
    for t in (q, k):
        first, second = t[..., :half].float(), t[..., half:].float()
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        t.copy_(rotated.to(t.dtype))


def _silu_and_mul(x, out=None):
    return _act_and_mul(x, F.silu, out)


def _gelu_tanh_and_mul(x, out=None):
    return _act_and_mul(x, lambda gate: F.gelu(gate, approximate="tanh"), out)


def _act_and_mul(x, act, out=None):
    """FlashInfer's act_and_mul kernel (every gated activation shares it):
    act in float32 on the gate half times the up half, rounded once."""
    _half_only(x)
    d = x.shape[-1] // 2
    _need(x.is_contiguous(), "act_and_mul reads row t at t * 2d: a strided input is read wrong")
    vector = 16 // x.element_size()
    rows = torch.arange(x.numel() // x.shape[-1])[:, None] * 2 * d
    lanes = torch.arange(0, d - d % vector, vector)[None, :]
    _vector_loads("input (gate half)", x, (rows + lanes).flatten(), 16)
    _vector_loads("input (up half)", x, (rows + d + lanes).flatten(), 16)
    result = (act(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype) if out is None else out
    _vector_loads("out", out, (torch.arange(out.numel() // d)[:, None] * d + lanes).flatten(), 16)
    out.copy_(result)
    return out


fake_flashinfer.norm = SimpleNamespace(rmsnorm=_rmsnorm, fused_add_rmsnorm=_fused_add_rmsnorm)
fake_flashinfer.rope = SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=_apply_rope_with_cos_sin_cache_inplace)
fake_flashinfer.activation = SimpleNamespace(silu_and_mul=_silu_and_mul, gelu_tanh_and_mul=_gelu_tanh_and_mul)


# -- the fused MoE (flashinfer.fused_moe.cutlass_fused_moe, TensorRT-LLM's CUTLASS MoE) ------


def _cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                       output_dtype, quant_scales=None, fc1_expert_biases=None, fc2_expert_biases=None,
                       tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, output=None, **options):
    """The unquantised SwiGLU path: out[t] = sum_j scale[t, j] * fc2[e] @
    (silu(fc1[e][I:] @ x[t]) * (fc1[e][:I] @ x[t])), e = ids[t, j]; each
    GEMM's output stored in the input's type, as the kernel's buffers are.
    The TMA loads read 16-byte aligned rows of dense tensors."""
    x, ids, scales, fc1, fc2 = input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights
    assert quant_scales in (None, []) and fc1_expert_biases is None and fc2_expert_biases is None
    assert (tp_size, ep_size) == (1, 1), "aioserve passes one rank's shards"
    _half_only(x, fc1, fc2)
    _need(output_dtype == x.dtype, f"output_dtype {output_dtype} is not the input's {x.dtype}")
    _need(ids.dtype == torch.int32, f"token_selected_experts are read as int32, got {ids.dtype}")
    _need(scales.dtype == torch.float32, f"token_final_scales are read as float32, got {scales.dtype}")
    for name, t in (("input", x), ("token_selected_experts", ids), ("token_final_scales", scales),
                    ("fc1_expert_weights", fc1), ("fc2_expert_weights", fc2)):
        _need(t.is_contiguous(), f"{name} is read densely: a strided view is read wrong")
    experts, hidden, inter = fc2.shape
    _need(x.dim() == 2 and x.shape[1] == hidden, f"input {tuple(x.shape)} is not [tokens, {hidden}]")
    _need(tuple(fc1.shape) == (experts, 2 * inter, hidden), f"fc1 {tuple(fc1.shape)} is not [E, 2I, H] of fc2's")
    _need(ids.shape == scales.shape and ids.shape[0] == x.shape[0], "ids and scales must be [tokens, k]")
    _need(bool(((ids >= 0) & (ids < experts)).all()), "an expert id out of range is read past the weights")
    for name, t, row in (("input", x, hidden), ("fc1", fc1, hidden), ("fc2", fc2, inter)):
        _need((row * t.element_size()) % 16 == 0, f"{name}'s rows of {row * t.element_size()} bytes break the TMA's "
              "16-byte alignment")
        _vector_loads(name, t, torch.zeros(1, dtype=torch.long), 16)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(experts):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        rows = x[token].float()
        up = (rows @ fc1[e, :inter].float().T).to(x.dtype).float()
        gate = (rows @ fc1[e, inter:].float().T).to(x.dtype).float()
        act = (F.silu(gate) * up).to(x.dtype).float()
        expert_out = (act @ fc2[e].float().T).to(x.dtype).float()
        out.index_add_(0, token, scales[token, slot, None] * expert_out)
    result = out.to(x.dtype)
    if output is not None:
        output.copy_(result)
        result = output
    return [result]  # as the newer versions do: a list holding the output


fake_flashinfer.fused_moe = SimpleNamespace(cutlass_fused_moe=_cutlass_fused_moe)


# -- aioserve's own fused kernel (aioserve/flashinfer/qk_rope_store.py, Triton on CUDA) ----------

def _qk_rope_store(q, k, v, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, out_cache_loc):
    """What the Triton kernel reads and writes, checked as its pointer
    arithmetic needs: the last dim of q, k, v dense (heads and tokens by
    stride), a dense pool of their dtype, halves of a power-of-two size, int64
    slots; then the torch form."""
    from aioserve.flashinfer.qk_rope_store import qk_rope_store_reference

    _half_only(q, k, v, k_cache, v_cache, *(w for w in (q_weight, k_weight) if w is not None))
    d = q.shape[-1]
    _need(d in (32, 64, 128, 256), f"head_dim {d}: the kernel's halves are power-of-two blocks of 16 to 128")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _need(t.dim() == 3 and t.stride(-1) == 1, f"{name} is read as [tokens, heads, dim] with a dense last dim")
    _need(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == k.shape[1:],
          "the pool is written at slot * Hk * D + head * D")
    _need(out_cache_loc.dtype == torch.int64 and positions.is_contiguous() and out_cache_loc.is_contiguous(),
          "slots are read as dense int64")
    _need(cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == d,
          "the cos|sin cache is read as dense float32 rows of head_dim")
    _need((q_weight is None) == (k_weight is None), "both norm weights or neither")
    return qk_rope_store_reference(q, k, v, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache,
                                   out_cache_loc)


fake_qk_rope_store = SimpleNamespace(qk_rope_store=_qk_rope_store)


# -- aioserve's own gate|up + SiLU kernel (aioserve/flashinfer/gate_up_silu.py, Triton on CUDA) ----

def _gate_up_silu(x, weight, block_n):
    """What the Triton kernel reads and writes, checked as its pointer
    arithmetic and its one 16-row tile need: rows of x with a dense last
    dim, a dense [2N, K] weight of x's dtype, a column block tl.dot takes;
    then the torch form."""
    from aioserve.flashinfer.gate_up_silu import gate_up_silu_reference

    _half_only(x, weight)
    _need(x.dim() == 2 and x.stride(1) == 1, "x is read as [rows, K] with a dense last dim")
    _need(1 <= x.shape[0] <= 16, f"{x.shape[0]} rows: the kernel's tile holds 16")
    _need(weight.is_contiguous() and weight.shape[1] == x.shape[1] and weight.shape[0] % 2 == 0,
          "the weight is read as dense [2N, K] rows, gate then up")
    _need(block_n in (16, 32, 64, 128), f"a column block of {block_n}: tl.dot takes powers of two from 16")
    return gate_up_silu_reference(x, weight)


fake_gate_up_silu = SimpleNamespace(gate_up_silu=_gate_up_silu)
