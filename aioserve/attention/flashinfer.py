"""Attention on CUDA with FlashInfer's paged kernels (the `gpu` extra).

One step plans twice at most, on the host, before any layer runs: the
decodes (the plan's first `num_decodes` requests) with the paged decode
wrapper, the extends (prefill chunks over a cached prefix, or none) with the
paged prefill wrapper, causal (an encoder's, AttentionShape.causal False:
not causal, over whole sequences only, backend.check_non_causal_plan). Every layer then stores its new K/V into the
pool and runs the planned kernels on its own slice of the pool; no layer
plans again and nothing reads a length off the device.

The pool's per-layer keys `[slots, Hk, D]` are FlashInfer's NHD layout
`[pages, page_size, Hk, D]` under a view: no copy, any page size.

A wrapper's `run` must use the `window_left` it was planned with (the
window picks the kernel at plan time; FlashInfer asserts it), so a model
whose layers differ in window (Gemma 3: sliding layers and global ones)
keeps one decode and one prefill wrapper per distinct window, each planned
every step, and a layer runs the pair of its own window.

For CUDA graphs (engine/cuda_graph.py) the backend keeps one decode wrapper
per captured batch size and window in FlashInfer's CUDA-graph mode; they
share fixed index buffers, which each `plan` rewrites in place (with the
same values) before a replay. Verify graphs (engine/verify_graph.py) keep
one prefill wrapper per captured size and window in the same mode: FlashInfer's
graph-mode prefill plan lets the query lengths vary from replay to replay
under a fixed request count and no more rows than the capture's (the runner
always plans exactly the capture's rows, so that the kernels' work lists
keep the sizes the graph baked in).

`flashinfer` is imported on first use (flashinfer/loader.py's
`load_flashinfer`, shared with the fused elementwise ops): without the extra
(or without CUDA) this module still imports, and `create_backend` falls
back to torch_native with one log line.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Protocol

import torch

from aioserve.attention.backend import (
    AttentionBackend, AttentionMetadata, AttentionShape, KVDestination, check_non_causal_plan,
)
from aioserve.attention.torch_native import both_ways_by_request, causal_mask
from aioserve.batch_plan import BatchPlan
from aioserve.flashinfer import contracts, loader
from aioserve.flashinfer.paged_args import PagedKVArgs, paged_kv_args, qo_indptr, window_left
from aioserve.kvcache.kv_pool import KVPool

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)
# Grouped heads at or above this share a KV head enough for the tensor-core
# decode kernel to win (the CUDA-core one re-reads K/V per query head).
TENSOR_CORE_MIN_GROUP = 4


class PagedWrapper(Protocol):
    """What is called on FlashInfer's paged decode and prefill wrappers (flashinfer ships no types)."""

    def plan(self, *args: Any, **kwargs: Any) -> None: ...

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *,
            out: torch.Tensor | None = None, window_left: int = -1) -> torch.Tensor: ...


class FlashInferMetadata(AttentionMetadata):
    def __init__(
        self,
        backend: "FlashInferBackend",
        out_cache_loc: torch.Tensor,
        num_decodes: int,
        decode: dict[int, PagedWrapper] | None,
        prefill: dict[int, PagedWrapper] | None,
    ) -> None:
        self.backend = backend
        self.out_cache_loc = out_cache_loc
        self.num_decodes = num_decodes
        self.decode = decode
        self.prefill = prefill

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        stored: bool = False,
    ) -> torch.Tensor:
        backend = self.backend
        if abs(scale - backend.sm_scale) > 1e-6 * backend.sm_scale:
            raise ValueError(f"layer {layer} asks for softmax scale {scale}, the plan used {backend.sm_scale}")
        pool = backend.pool
        if not stored:
            pool.store(layer, self.out_cache_loc, k, v)
        cache = backend.paged_cache(layer)
        window = window_left(sliding_window)
        # q is a view into the fused q|k|v projection's rows (RoPE rotated it
        # in place); the kernels are handed dense heads.
        q = q.contiguous()
        nd = self.num_decodes
        if self.prefill is None:  # decode-only: no copy into a second output
            assert self.decode is not None
            return self.decode[window].run(q, cache, window_left=window)
        out = torch.empty_like(q)
        if nd:
            assert self.decode is not None  # planned for the decodes
            self.decode[window].run(q[:nd], cache, out=out[:nd], window_left=window)
        self.prefill[window].run(q[nd:], cache, out=out[nd:], window_left=window)
        return out

    def kv_destination(self, layer: int) -> KVDestination | None:
        pool = self.backend.pool
        if pool.dtype not in contracts.HALF:  # an FP8 cache: pool.store quantises
            return None
        return KVDestination(pool.keys(layer), pool.values(layer), self.out_cache_loc)


def both_ways_mask(plan: BatchPlan) -> torch.Tensor | None:
    """The extends' masks, flattened and concatenated, where some rows of
    the step attend both ways (None: the step is plainly causal). A row sees
    the keys up to itself, or up to the last row of its both-ways block."""
    nd = plan.num_decodes
    extend_lens = plan.extend_lens[nd:].tolist()
    blocks = both_ways_by_request(plan, plan.extend_lens.tolist())
    if not blocks:
        return None
    masks = []
    for i, (length, total) in enumerate(zip(extend_lens, plan.seq_lens[nd:].tolist()), start=nd):
        masks.append(causal_mask(length, total - length, blocks.get(i, [])).flatten())
    return torch.cat(masks)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, pool: KVPool, shape: AttentionShape, flashinfer: ModuleType | None = None) -> None:
        fi = flashinfer or loader.load_flashinfer()
        if fi is None:
            raise ImportError(f"flashinfer does not import: {loader.FLASHINFER.import_error}")
        self.fi: ModuleType = fi
        self.pool = pool
        self.shape = shape
        self.sm_scale = shape.sm_scale or shape.head_dim**-0.5  # planned once: every layer uses it
        device = pool.buffer.device
        self.on_cuda = device.type == "cuda"
        # One float workspace for every wrapper: the wrappers of a step run one
        # after another on one stream, never at once.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.use_tensor_cores = shape.num_qo_heads // shape.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        if any(w is not None for w in shape.sliding_windows) and not shape.causal:
            raise ValueError("a sliding window needs causal attention (the model is an encoder)")
        # Every layer's window_left (-1: full attention), one wrapper pair each.
        self.windows = sorted({window_left(w) for w in shape.sliding_windows}) or [-1]
        self.decode: dict[int, PagedWrapper] = {w: self._decode_wrapper() for w in self.windows}
        self.prefill: dict[int, PagedWrapper] = {
            w: self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD") for w in self.windows
        }
        self.graph_decodes: dict[int, dict[int, PagedWrapper]] = {}
        self.graph_prefills: dict[int, dict[int, PagedWrapper]] = {}
        # Set after each step's plans: their uploads read pinned staging
        # buffers that the next step's plans overwrite (see _before_planning).
        self._planned: torch.cuda.Event | None = None

    @property
    def supports_graphs(self) -> bool:
        """Decodes replay from its graph buffers; an encoder has no decodes."""
        return self.shape.causal

    def _before_planning(self) -> None:
        """Each wrapper's `plan` writes its page-locked staging buffer and
        queues an upload from it on the stream. With overlap this step is
        planned while the last one may not have reached its uploads yet, so
        wait for those (they sit at that step's very start: the wait is short,
        since the step before it has finished when the scheduler plans this one)."""
        if self._planned is not None:
            self._planned.synchronize()

    def _after_planning(self) -> None:
        if self.on_cuda:  # (the CPU tests run a torch stand-in of the wrappers)
            self._planned = torch.cuda.Event()
            self._planned.record()

    def _upload(self, args: PagedKVArgs) -> PagedKVArgs:
        """Host arrays in pinned memory and the page ids already on the device:
        FlashInfer copies a host `indices` into a graph wrapper's buffer with a
        blocking copy, which waits for the whole stream (the previous step)."""
        if not self.on_cuda:
            return args
        return PagedKVArgs(
            args.indptr.pin_memory(),
            args.indices.pin_memory().to(self.pool.buffer.device, non_blocking=True),
            args.last_page_len.pin_memory(),
        )

    def paged_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.pool
        view = (pool.num_pages, pool.page_size, pool.num_kv_heads, pool.head_dim)
        return pool.keys(layer).view(view), pool.values(layer).view(view)

    def _decode_wrapper(self, **graph_buffers: Any) -> PagedWrapper:
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, **graph_buffers
        )

    def _plan_decode(self, wrappers: dict[int, PagedWrapper], args: PagedKVArgs) -> None:
        s = self.shape
        for window, wrapper in wrappers.items():
            wrapper.plan(
                args.indptr, args.indices, args.last_page_len,
                s.num_qo_heads, s.num_kv_heads, s.head_dim, self.pool.page_size,
                window_left=window, q_data_type=s.q_dtype, kv_data_type=self.pool.dtype,
                sm_scale=self.sm_scale,
            )

    def _plan_extends(self, wrappers: dict[int, PagedWrapper], host_plan: BatchPlan, first: int,
                      mask: torch.Tensor | None = None) -> None:
        """Plan `wrappers` (prefill, one per window) for the plan's requests
        from `first` on. `mask`: a step with rows that attend both ways
        (Gemma 3's images): each extend's [new tokens, KV length] bool mask,
        flattened and concatenated, in place of the causal one (a layer's
        window still applies at run time, as a lower bound on the keys)."""
        args = self._upload(paged_kv_args(host_plan.page_table[first:], host_plan.seq_lens[first:], self.pool.page_size))
        qo = qo_indptr(host_plan.extend_lens[first:])
        qo = qo.pin_memory() if self.on_cuda else qo
        s = self.shape
        extra = {} if mask is None else {"custom_mask": mask}
        for window, wrapper in wrappers.items():
            wrapper.plan(
                qo, args.indptr, args.indices, args.last_page_len,
                s.num_qo_heads, s.num_kv_heads, s.head_dim, self.pool.page_size,
                causal=s.causal and mask is None, window_left=window, q_data_type=s.q_dtype,
                kv_data_type=self.pool.dtype, sm_scale=self.sm_scale, **extra,
            )

    def prepare(self, plan: BatchPlan, host_plan: BatchPlan) -> FlashInferMetadata:
        nd, batch = host_plan.num_decodes, host_plan.num_requests
        ps = self.pool.page_size
        if not self.shape.causal:
            check_non_causal_plan(host_plan)
        self._before_planning()
        if nd:
            args = paged_kv_args(host_plan.page_table[:nd], host_plan.seq_lens[:nd], ps)
            self._plan_decode(self.decode, self._upload(args))
        if batch > nd:
            mask = both_ways_mask(host_plan) if host_plan.images is not None else None
            if mask is not None and self.on_cuda:
                mask = mask.pin_memory().to(self.pool.buffer.device, non_blocking=True)
            self._plan_extends(self.prefill, host_plan, nd, mask)
        self._after_planning()
        return FlashInferMetadata(
            self, plan.out_cache_loc, nd, self.decode if nd else None, self.prefill if batch > nd else None
        )

    # -- CUDA graphs -----------------------------------------------------------------

    def init_graph_buffers(self, max_bs: int, max_pages_per_request: int) -> None:
        device = self.pool.buffer.device
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.graph_indices = torch.zeros(max_bs * max_pages_per_request, dtype=torch.int32, device=device)
        self.graph_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)

    def graph_metadata(self, batch_size: int, out_cache_loc: torch.Tensor) -> FlashInferMetadata:
        # A CUDA-graph wrapper's batch size is fixed for life: one per size
        # and window, all over the same buffers (one size replays at a time).
        wrappers = {
            window: self._decode_wrapper(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self.graph_indptr[: batch_size + 1],
                paged_kv_indices_buffer=self.graph_indices,
                paged_kv_last_page_len_buffer=self.graph_last_page_len[:batch_size],
            )
            for window in self.windows
        }
        self.graph_decodes[batch_size] = wrappers
        return FlashInferMetadata(self, out_cache_loc, batch_size, wrappers, None)

    def update_graph_buffers(self, host_plan: BatchPlan) -> None:
        wrappers = self.graph_decodes[host_plan.num_requests]
        self._before_planning()
        args = paged_kv_args(host_plan.page_table, host_plan.seq_lens, self.pool.page_size)
        self._plan_decode(wrappers, self._upload(args))
        self._after_planning()

    # -- verify graphs ------------------------------------------------------------------

    @property
    def supports_verify_graphs(self) -> bool:
        return self.shape.causal

    def init_verify_graph_buffers(self, max_requests: int, max_pages: int) -> None:
        device = self.pool.buffer.device
        self.verify_qo_indptr = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        self.verify_indptr = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        self.verify_indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self.verify_last_page_len = torch.zeros(max_requests, dtype=torch.int32, device=device)

    def verify_graph_metadata(self, num_requests: int, out_cache_loc: torch.Tensor) -> FlashInferMetadata:
        wrappers: dict[int, PagedWrapper] = {
            window: self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                qo_indptr_buf=self.verify_qo_indptr[: num_requests + 1],
                paged_kv_indptr_buf=self.verify_indptr[: num_requests + 1],
                paged_kv_indices_buf=self.verify_indices,
                paged_kv_last_page_len_buf=self.verify_last_page_len[:num_requests],
            )
            for window in self.windows
        }
        self.graph_prefills[num_requests] = wrappers
        return FlashInferMetadata(self, out_cache_loc, 0, None, wrappers)

    def update_verify_graph_buffers(self, host_plan: BatchPlan) -> None:
        self._before_planning()
        self._plan_extends(self.graph_prefills[host_plan.num_requests], host_plan, 0)
        self._after_planning()
