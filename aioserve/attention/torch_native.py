"""Attention in plain torch ops: runs on CPU and GPU, and is the reference.

Decodes (one new token each) are attended as one padded batch: every
request's KV slots are gathered into a [B, max_len] grid, padding points at
the reserved zero page and is masked out. On CPU, when native/ builds, the
decodes instead go to a C++ kernel that reads the pages in place (2-3x
faster, no gather copy), and so do short extends after a prefix (a
verified draft of speculative decoding, a short chunk after a cached
prefix): each of their new tokens is a decode at its own length over the
same pages, whose KV is stored before any is read. Longer extends (prefill
chunks) are attended one request at a time with a causal mask shifted by
the cached prefix, so a long prompt never pads the short ones; side-by-side chunks of one length with nothing
cached before them (a burst of equal prompts) attend as one batch. On a CPU
with AMX, bf16 chunks that are causal (fresh, or after a cached prefix, a
sliding window or none; no image rows) go to native/prefill_attention.cpp's
kernel on the tiles instead of SDPA, written straight into the output.

A non-causal backend (encoders: `causal=False`) attends each sequence's
tokens to all of its tokens. Its plans hold whole sequences only, nothing
cached before them (backend.check_non_causal_plan), so every request is an
extend without a prefix (or a one-token one, which is the same either way)
and the same paths serve it with the causal mask dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from aioserve.attention.backend import AttentionBackend, AttentionMetadata, KVDestination, check_non_causal_plan
from aioserve.batch_plan import BatchPlan, extend_runs_as_decodes, token_rows
from aioserve.kvcache.kv_pool import KVPool, to_cache_dtype
from aioserve.cpu.native import cpu_kernels


def kv_slots(page_rows: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of positions [0, length) for each page-table row: [B, length]."""
    positions = torch.arange(length, device=page_rows.device)
    pages = page_rows[:, positions // page_size].long()
    return pages * page_size + positions % page_size


@dataclass
class _Extend:
    start: int  # first row in the flat token batch
    length: int  # new tokens
    prefix: int  # cached tokens before them
    slots: torch.Tensor | None  # [prefix + length] KV slots, None when there is no prefix
    device: torch.device
    # [first, end) of its new tokens (0 = its first) that attend to each
    # other both ways (an image's tokens in Gemma 3), else causal.
    both_ways: list[tuple[int, int]] = field(default_factory=list)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[length, prefix + length] bool; None means plain causal (no
        prefix, no window, nothing both ways). A window bounds how far back
        a query reaches, both ways' rows' too (Gemma 3's sliding layers)."""
        if window not in self.masks:
            if self.prefix == 0 and window is None and not self.both_ways:
                self.masks[window] = None
            else:
                allowed = causal_mask(self.length, self.prefix, self.both_ways, self.device)
                if window is not None:  # a lower bound only (as transformers' Gemma 3 masks)
                    q_pos = torch.arange(self.length, device=self.device)[:, None] + self.prefix
                    k_pos = torch.arange(self.prefix + self.length, device=self.device)[None, :]
                    allowed &= k_pos > q_pos - window
                self.masks[window] = allowed
        return self.masks[window]


def causal_mask(
    length: int, prefix: int, both_ways: list[tuple[int, int]], device: torch.device | None = None
) -> torch.Tensor:
    """[length, prefix + length] bool: `length` new tokens after `prefix`
    cached ones, each seeing the keys up to itself, or up to the last row of
    its `both_ways` block ([first, end) of the new tokens)."""
    last_seen = torch.arange(length, device=device) + prefix  # the last key each query sees
    for first, end in both_ways:
        last_seen[first:end] = prefix + end - 1
    return torch.arange(prefix + length, device=device)[None, :] <= last_seen[:, None]


def both_ways_by_request(plan: BatchPlan, extend_lens: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Request index -> its rows that attend to each other both ways (an
    image's in Gemma 3), counted from its first new token."""
    ranges = plan.images.both_ways() if plan.images is not None else []
    found: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for i, length in enumerate(extend_lens):
        for first, end in ranges:
            if start <= first < start + length:
                found.setdefault(i, []).append((first - start, end - start))
        start += length
    return found


def _fresh_runs(extends: list[_Extend]) -> list[list[_Extend]]:
    """The extends in order, side-by-side ones (adjacent rows) of one length
    with nothing cached before them grouped into one run."""
    runs: list[list[_Extend]] = []
    for ext in extends:
        last = runs[-1][-1] if runs else None
        if (
            last is not None and ext.prefix == 0 and last.prefix == 0 and ext.length == last.length
            and ext.start == last.start + last.length  # side by side in the batch (a paged extend may sit between)
        ):
            runs[-1].append(ext)
        else:
            runs.append([ext])
    return runs


# AIOSERVE_PREFILL_ATTENTION=0 keeps prompts on torch's SDPA where a native kernel would serve them.
NATIVE_PREFILL = os.environ.get("AIOSERVE_PREFILL_ATTENTION", "1") != "0"


def native_prefill_fits(kernels: ModuleType | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a native causal prompt kernel can take these chunks: bf16 on
    AMX tiles (native/prefill_attention.cpp, ~1.5x torch's SDPA on a 2-core
    Emerald Rapids VM; a head dim of whole 32-element tile rows, the tiles
    in use), or float32 on AVX-512 FMAs (native/prefill_attention_f32.cpp,
    1.3-1.6x SDPA there; a head dim of whole vectors)."""
    if not NATIVE_PREFILL or kernels is None or not q.is_cpu or q.dtype != k.dtype:
        return False
    dim = q.shape[-1]
    if q.dtype == torch.bfloat16:
        return dim % 32 == 0 and dim <= 256 and bool(kernels.prefill_tiles_ready())
    if q.dtype == torch.float32:
        return dim % 16 == 0 and dim <= 256 and bool(kernels.prefill_f32_ready())
    return False


class GatherWorkspace:
    """Grow-only buffers for gathered keys and values, reused by every layer
    and step: a fresh large tensor per layer costs more in page faults than
    the gather itself."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def get(self, index: int, rows: int, like: torch.Tensor) -> torch.Tensor:
        shape = (rows, *like.shape[1:])
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < rows * like[0].numel() or buffer.dtype != like.dtype:
            buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._buffers[index] = buffer
        return buffer.view(-1)[: rows * like[0].numel()].view(shape)


class TorchNativeMetadata(AttentionMetadata):
    def __init__(
        self, pool: KVPool, plan: BatchPlan, host_plan: BatchPlan, workspace: GatherWorkspace, kernels: ModuleType | None,
        causal: bool = True,
    ) -> None:
        self.pool = pool
        self.causal = causal
        self.workspace = workspace
        self.kernels = kernels
        self.out_cache_loc = plan.out_cache_loc
        # Lengths come from the host copy: reading them off the device would
        # wait for the step still running there.
        seq_lens = host_plan.seq_lens.tolist()
        extend_lens = host_plan.extend_lens.tolist()
        nd = plan.num_decodes
        self.num_decodes = nd
        self._decode_masks: dict[int | None, torch.Tensor] = {}
        # Rows the native decode kernel attends: the decodes, then (with the
        # kernels) short extends' tokens; `paged_rows` None means rows [0, nd).
        self.paged_rows: torch.Tensor | None = None
        # Each extend's rows that attend both ways (an extend with some is never run as decodes).
        blocks = both_ways_by_request(host_plan, extend_lens)
        short = {
            i for i in range(nd, plan.num_requests)
            if extend_runs_as_decodes(extend_lens[i], seq_lens[i]) and not blocks.get(i)
        } if kernels else set()
        if nd:
            self.decode_pages = plan.page_table[:nd]
            self.decode_lens = plan.seq_lens[:nd]
        if short:
            self._page_short_extends(plan, short, seq_lens, extend_lens)
        if nd and kernels is None:
            max_len = max(seq_lens[:nd])
            lens = plan.seq_lens[:nd]
            self.decode_slots = kv_slots(plan.page_table[:nd], max_len, pool.page_size)
            self._decode_k_pos = torch.arange(max_len, device=lens.device)[None, :]
            self._decode_q_pos = (lens - 1)[:, None]
            valid = self._decode_k_pos <= self._decode_q_pos
            self.decode_slots.masked_fill_(~valid, 0)  # padding reads the zero page
            self.decode_slots = self.decode_slots.flatten()
            self._decode_masks[None] = valid
        self.extends: list[_Extend] = []
        start = nd
        for i in range(nd, plan.num_requests):
            length, total = extend_lens[i], seq_lens[i]
            prefix = total - length
            if i not in short:
                slots = kv_slots(plan.page_table[i : i + 1], total, pool.page_size)[0] if prefix else None
                self.extends.append(_Extend(start, length, prefix, slots, plan.input_ids.device, blocks.get(i, [])))
            start += length
        self.extend_runs = _fresh_runs(self.extends)

    def _page_short_extends(self, plan: BatchPlan, short: set[int], seq_lens: list[int], extend_lens: list[int]) -> None:
        """The decodes' and the `short` extends' tokens, each as a decode: its
        row of the batch, its request's page row, its length up to and
        including it."""
        owners, lengths = token_rows(seq_lens, extend_lens)
        rows = [t for t, owner in enumerate(owners) if owner < plan.num_decodes or owner in short]
        device = plan.seq_lens.device
        self.paged_rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.decode_pages = plan.page_table[torch.tensor([owners[t] for t in rows], dtype=torch.long, device=device)]
        self.decode_lens = torch.tensor([lengths[t] for t in rows], dtype=plan.seq_lens.dtype, device=device)

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, max_len]: valid positions, within the window if any."""
        if window not in self._decode_masks:
            assert window is not None  # the full mask (key None) is made with the plan
            self._decode_masks[window] = self._decode_masks[None] & (
                self._decode_k_pos > self._decode_q_pos - window
            )
        return self._decode_masks[window][:, None, None, :]

    def native_kv_destination(self, layer: int) -> KVDestination | None:
        if self.kernels is None:
            return None
        return KVDestination(self.pool.keys(layer), self.pool.values(layer), self.out_cache_loc)

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
        if not self.causal and sliding_window is not None:
            raise ValueError(f"layer {layer}: a sliding window needs causal attention")
        keys, values = self.pool.keys(layer), self.pool.values(layer)
        if not stored:
            self.pool.store(layer, self.out_cache_loc, k, v)
        if keys.dtype != q.dtype and self.extends:
            # A narrower cache: attend to the new tokens as later steps will
            # read them back (decodes read them from the cache already).
            k, v = to_cache_dtype(k, keys.dtype).to(q.dtype), to_cache_dtype(v, keys.dtype).to(q.dtype)
        out = torch.empty_like(q)
        nd = self.num_decodes
        if self.paged_rows is not None:
            attended = self._attend_decodes(q.index_select(0, self.paged_rows), keys, values, scale, sliding_window)
            out.index_copy_(0, self.paged_rows, attended)
        elif nd:
            out[:nd] = self._attend_decodes(q[:nd], keys, values, scale, sliding_window)
        # Prompts through a native kernel where one fits (native_prefill_fits), written into out.
        fits = self.causal and bool(self.extend_runs) and out.is_contiguous() and native_prefill_fits(self.kernels, q, k)
        native = self.kernels if fits else None
        for run in self.extend_runs:
            if len(run) > 1 and run[0].mask(sliding_window) is None:
                rows = slice(run[0].start, run[-1].start + run[-1].length)
                if native is not None:
                    native.causal_prefill_attention(q[rows], k[rows], v[rows], len(run), scale, out[rows])
                else:
                    out[rows] = self._attend_fresh(q[rows], k[rows], v[rows], len(run), scale, self.causal)
                continue
            for ext in run:
                rows = slice(ext.start, ext.start + ext.length)
                if ext.slots is None:
                    ek, ev = k[rows], v[rows]
                else:
                    ek = keys.index_select(0, ext.slots).to(q.dtype)
                    ev = values.index_select(0, ext.slots).to(q.dtype)
                if native is not None and not ext.both_ways:  # causal rows only (a window the kernel takes)
                    native.causal_prefill_attention(q[rows], ek, ev, 1, scale, out[rows], sliding_window)
                else:
                    out[rows] = self._attend_extend(q[rows], ek, ev, ext.mask(sliding_window), scale, self.causal)
        return out

    @staticmethod
    def _attend_fresh(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float, causal: bool = True
    ) -> torch.Tensor:
        """`count` requests' chunks of one length side by side, nothing cached
        before them: one causal call over [count, heads, length, dim], the
        same numbers as a call per request (each (request, head) is its own
        block of the kernel). tiny-llama, 4 prompts of 65 tokens: 0.29-0.33
        ms a layer against 0.39-0.41 for four calls."""
        def batched(x: torch.Tensor) -> torch.Tensor:
            return x.view(count, -1, *x.shape[1:]).transpose(1, 2)

        attended = F.scaled_dot_product_attention(
            batched(q), batched(k), batched(v), is_causal=causal, scale=scale, enable_gqa=True
        )
        return attended.transpose(1, 2).reshape(q.shape)

    @staticmethod
    def _attend_extend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
        causal: bool = True,
    ) -> torch.Tensor:
        """One request's chunk, [L, H, D] in and out (`mask` None: plain
        causal, or no mask at all when not `causal`). Inputs go in 4-D, the
        layout CUDA's fused kernels require (3-D falls back to the slow math
        path). Their masked kernel does not take grouped KV heads, so on CUDA
        a masked chunk gets its KV heads repeated instead."""
        gqa = True
        if mask is not None and q.is_cuda and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None and causal,
            scale=scale,
            enable_gqa=gqa,
        )
        return attended[0].transpose(0, 1)

    def _attend_decodes(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.paged_decode_attention(
                q, keys, values, self.decode_pages, self.decode_lens, self.pool.page_size, scale, window or 0
            )
        batch, num_heads, dim = q.shape
        num_kv_heads = keys.shape[1]
        # Group query heads under their KV head: [B, Hk, G, D] against [B, Hk, L, D]
        # attends GQA without repeating keys.
        grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, dim)
        rows = self.decode_slots.numel()
        dk = torch.index_select(keys, 0, self.decode_slots, out=self.workspace.get(0, rows, keys))
        dv = torch.index_select(values, 0, self.decode_slots, out=self.workspace.get(1, rows, values))
        dk = dk.view(batch, -1, num_kv_heads, dim).transpose(1, 2).to(q.dtype)
        dv = dv.view(batch, -1, num_kv_heads, dim).transpose(1, 2).to(q.dtype)
        attended = F.scaled_dot_product_attention(grouped, dk, dv, attn_mask=self._decode_mask(window), scale=scale)
        return attended.reshape(batch, num_heads, dim)


class GraphDecodeMetadata(AttentionMetadata):
    """Decodes read through static page-table and length buffers (the native
    CPU kernel takes both as tensors): what the graph runner's seam needs on
    CPU, where a "replay" reruns the step over the same buffers."""

    def __init__(self, pool: KVPool, kernels: ModuleType, out_cache_loc: torch.Tensor, pages: torch.Tensor,
                 lens: torch.Tensor) -> None:
        self.pool, self.kernels = pool, kernels
        self.out_cache_loc, self.pages, self.lens = out_cache_loc, pages, lens

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None,
        stored: bool = False,
    ) -> torch.Tensor:
        if not stored:
            self.pool.store(layer, self.out_cache_loc, k, v)
        return self.kernels.paged_decode_attention(
            q, self.pool.keys(layer), self.pool.values(layer), self.pages, self.lens, self.pool.page_size, scale,
            sliding_window or 0,
        )


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self, pool: KVPool, use_native: bool = True, causal: bool = True) -> None:
        self.pool = pool
        self.causal = causal  # False: an encoder's bidirectional attention (AttentionShape.causal)
        self.workspace = GatherWorkspace()
        self.use_native = use_native and pool.buffer.device.type == "cpu"
        if self.use_native:
            cpu_kernels(wait=False)  # a first start builds them in the background

    @property
    def kernels(self) -> ModuleType | None:
        """The native kernels once built; until then the torch twins serve."""
        return cpu_kernels(wait=False) if self.use_native else None

    def prepare(self, plan: BatchPlan, host_plan: BatchPlan) -> TorchNativeMetadata:
        if not self.causal:
            check_non_causal_plan(host_plan)
        return TorchNativeMetadata(self.pool, plan, host_plan, self.workspace, self.kernels, self.causal)

    # -- graph seam (CPU, native kernels only) ----------------------------------------

    @property
    def supports_graphs(self) -> bool:
        """Only the native CPU decode kernel reads its lengths from tensors;
        the torch path sizes its gather from host lengths, which a CUDA graph
        would freeze. (CPU has no graphs: this serves the runner's tests.)
        An encoder has no decodes to replay."""
        return self.kernels is not None and self.causal

    def init_graph_buffers(self, max_bs: int, max_pages_per_request: int) -> None:
        self.graph_pages = torch.zeros(max_bs, max_pages_per_request, dtype=torch.int32)
        self.graph_lens = torch.zeros(max_bs, dtype=torch.long)

    def graph_metadata(self, batch_size: int, out_cache_loc: torch.Tensor) -> GraphDecodeMetadata:
        assert self.kernels is not None
        return GraphDecodeMetadata(
            self.pool, self.kernels, out_cache_loc, self.graph_pages[:batch_size], self.graph_lens[:batch_size]
        )

    def update_graph_buffers(self, host_plan: BatchPlan) -> None:
        bs, width = host_plan.page_table.shape
        self.graph_pages[:bs].zero_()
        self.graph_pages[:bs, :width].copy_(host_plan.page_table)
        self.graph_lens[:bs].copy_(host_plan.seq_lens)
