"""A stand-in for the two FlashInfer wrappers aioserve uses, in plain torch
on CPU, read off FlashInfer's documented semantics: paged KV described by
(indptr, indices, last_page_len), queries by qo_indptr, causal attention
aligned to the end of each request's KV, `window_left` inclusive, NHD
layout, and CUDA-graph mode planning into caller-owned buffers that `run`
reads back. With it the FlashInfer backend's planning, row routing and
graph buffers run on CPU against the torch_native reference; the real
kernels are tested on a GPU (tests/test_gpu_fast_path.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def _attend(q, k_cache, v_cache, qo_indptr, indptr, indices, last_page_len, scale, window_left, out):
    page_size, hk = k_cache.shape[1], k_cache.shape[2]
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
        allowed = k_pos <= q_pos
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

    def _run(self, q, paged_kv_cache, out, window_left, qo_indptr):
        p = self.planned
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (p.page_size, p.num_kv_heads, p.head_dim) and q.shape[1] == p.num_qo_heads
        assert q.dtype == p.q_data_type and k_cache.dtype == p.kv_data_type
        out = torch.empty_like(q) if out is None else out
        window = p.window_left if window_left is None else window_left
        return _attend(q, k_cache, v_cache, qo_indptr, p.indptr, p.indices, p.last_page_len, p.sm_scale, window, out)


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
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, window_left=-1, q_data_type=torch.float16,
             kv_data_type=None, sm_scale=None):
        assert causal, "aioserve's extends are causal"
        assert qo_indptr.device.type == "cpu", "plan takes host arrays"
        self.plans += 1
        self.planned = SimpleNamespace(
            qo_indptr=qo_indptr, indptr=paged_kv_indptr, indices=paged_kv_indices,
            last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk, page_size=page_size, window_left=window_left, q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type, sm_scale=sm_scale or head_dim_qk**-0.5,
        )

    def run(self, q, paged_kv_cache, *, out=None, window_left=None):
        assert q.shape[0] == int(self.planned.qo_indptr[-1]), "one query per planned token"
        return self._run(q, paged_kv_cache, out, window_left, self.planned.qo_indptr)


fake_flashinfer = SimpleNamespace(
    BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
)


# -- the fused elementwise ops (flashinfer.norm / rope / activation) ----------------


def _rmsnorm(x, weight, eps=1e-6, out=None):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _fused_add_rmsnorm(x, residual, weight, eps=1e-6):
    residual.add_(x)  # residual += input, then input = norm(residual)
    x.copy_(_rmsnorm(residual, weight, eps))


def _apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    assert is_neox and cos_sin_cache.dtype == torch.float32
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions, :half][:, None, :], cos_sin_cache[positions, half:][:, None, :]
    for t in (query.view(query.shape[0], -1, head_size), key.view(key.shape[0], -1, head_size)):
        first, second = t[..., :half].float(), t[..., half:].float()
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        t.copy_(rotated.to(t.dtype))


def _silu_and_mul(x, out=None):
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


fake_flashinfer.norm = SimpleNamespace(rmsnorm=_rmsnorm, fused_add_rmsnorm=_fused_add_rmsnorm)
fake_flashinfer.rope = SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=_apply_rope_with_cos_sin_cache_inplace)
fake_flashinfer.activation = SimpleNamespace(silu_and_mul=_silu_and_mul)
