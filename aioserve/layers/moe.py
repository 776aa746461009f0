"""Mixture of experts without shared experts (Qwen3-MoE, Mixtral): a
replicated top-k router and the experts' weights stacked into [E, ...]
tensors, computed as one grouped matmul per projection.

Tensor parallelism shards every expert's intermediate dimension over the
ranks (gate/up by rows, down by columns, as the dense MLP does), so each
rank computes a partial sum for every routed token and one all-reduce after
the down projection completes it. The router runs, identically, on every rank.

On CUDA the experts run as FlashInfer's fused MoE kernel where its contract
and a one-time self-check hold (flashinfer/moe.py), else as the grouped
torch form here; on the CPU as the native packed matmul when built.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from aioserve.flashinfer.moe import FlashInferExperts
from aioserve.layers.activation import silu_and_mul
from aioserve.tp.distributed import all_reduce, get_tp_group

GATE, UP, DOWN = 0, 1, 2  # an expert projection's part in a checkpoint shard id (expert, part)


class TopKRouter(nn.Module):
    """softmax over the experts' logits, the top k, renormalised to sum to
    one when the config says so (Mixtral always, Qwen3-MoE by
    `norm_topk_prob`). Replicated: every rank routes every token alike."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        if tuple(loaded.shape) != tuple(self.weight.shape):
            raise ValueError(f"router {name}: checkpoint shape {tuple(loaded.shape)} != {tuple(self.weight.shape)}")
        self.weight.data.copy_(loaded[:])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


def _grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch's grouped matmul wants 16-byte aligned strides and pointers
    (and on CUDA bfloat16 on a Hopper or newer); else the per-expert form."""
    if a.device.type == "cuda":
        if a.dtype != torch.bfloat16 or torch.cuda.get_device_capability(a.device)[0] < 9:
            return False
    if (b.shape[-1] * b.element_size()) % 16:  # the output's rows
        return False
    for t in (a, b):
        if t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s, n in zip(t.stride(), t.shape) if s != 1):
            return False
    return True


def packed_grouped_matmul(
    x: torch.Tensor, packed: list[torch.Tensor], features: int, ends: torch.Tensor, kernels: ModuleType
) -> torch.Tensor:
    """grouped_matmul's product with each expert's weight packed for the CPU's
    native kernel (aioserve/cpu/matmul.py): one call per expert that got rows,
    1.6-2.3x faster than torch's grouped form for 16-1024 rows over 8 experts
    of [512, 256] on a 2-core AVX2 box."""
    out = x.new_empty(x.shape[0], features)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            kernels.packed_linear(x[start:end], packed[expert], None, features, False, out[start:end])
        start = end
    return out


def masked_grouped_matmul(x: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The grouped product without reading `ends` on the host, as a CUDA graph
    capture needs (a decode step's few rows, where torch's grouped kernel
    does not take the dtype or GPU): every row times every expert, each
    product kept only for that expert's rows. E times the work."""
    row = torch.arange(x.shape[0], device=x.device)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    out = x.new_zeros(x.shape[0], b.shape[2])
    for expert in range(b.shape[0]):
        mine = (row >= starts[expert]) & (row < ends[expert])
        out += mine.unsqueeze(1).to(x.dtype) * (x @ b[expert])
    return out


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by expert, expert e's rows ending at ends[e]; row r
    of expert e times weights[e]^T. weights: [E, N, K] -> out [rows, N]."""
    b = weights.transpose(1, 2)
    if x.shape[0] and _grouped_mm_fits(x, b):
        return F.grouped_mm(x, b, offs=ends)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return masked_grouped_matmul(x, b, ends)
    # The per-expert form (unaligned tiny shapes): one matmul for each expert
    # that received rows, none for the others.
    out = x.new_empty(x.shape[0], weights.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            torch.matmul(x[start:end], b[expert], out=out[start:end])
        start = end
    return out


# One projection over rows sorted by expert: (rows, ends, gate_up) -> the rows' gate/up or down products.
Project = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


def routed_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int, project: Project
) -> torch.Tensor:
    """The grouped torch form, before the all-reduce: the T x k (token,
    expert) pairs sorted by expert, each projection one grouped product over
    them, the rows scaled by their routing weight and summed per token."""
    k = ids.shape[1]
    sorted_ids, order = ids.reshape(-1).sort(stable=True)
    tokens = order // k
    # Where each expert's rows end in the sorted order (no host sync).
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device), right=True)
    ends = ends.to(torch.int32)
    rows = x.index_select(0, tokens)
    hidden = silu_and_mul(project(rows, ends, True))
    out = project(hidden, ends, False)
    out = out * weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, out)


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """routed_experts over stacked [gate | up] and down weights (the fused kernel's self-check reference)."""
    return routed_experts(x, weights, ids, w13.shape[0], lambda rows, ends, gate_up: grouped_matmul(
        rows, w13 if gate_up else w2, ends))


class FusedMoE(nn.Module):
    """The experts: w13 [E, 2 * I/tp, H] holds each expert's [gate | up]
    shard, w2 [E, H, I/tp] its down shard. Loaded from Hugging Face's
    per-expert tensors with shard ids (expert, GATE | UP | DOWN)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        tp = get_tp_group()
        if intermediate % tp.size:
            raise ValueError(f"an expert intermediate size of {intermediate} does not divide over {tp.size} ranks")
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.shard = intermediate // tp.size
        self.start = tp.rank * self.shard
        self.hidden = hidden
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.shard), requires_grad=False)
        # CPU: each expert's w13 and w2 packed for the native kernel (pack_for_cpu), in place of the stacks.
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._kernels: ModuleType | None = None
        self.flashinfer = FlashInferExperts(grouped_experts)  # CUDA: the fused kernel, where it is chosen

    def pack_for_cpu(self, kernels: ModuleType, storage_dtype: torch.dtype | None) -> None:
        """Pack every expert's projections for the native matmul, at
        `storage_dtype`'s width when that is narrower (the values were rounded
        to it), and free the stacked copies. Once, after loading."""

        def pack(weight: torch.Tensor) -> torch.Tensor:
            if storage_dtype is not None and storage_dtype.itemsize < weight.dtype.itemsize:
                weight = weight.to(storage_dtype)
            return kernels.pack_linear_weight(weight.contiguous())

        with torch.inference_mode():
            self.packed = ([pack(w) for w in self.w13.data], [pack(w) for w in self.w2.data])
        self._kernels = kernels
        self.w13.data = self.w13.data.new_empty(0)
        self.w2.data = self.w2.data.new_empty(0)

    def _project(self, x: torch.Tensor, ends: torch.Tensor, gate_up: bool) -> torch.Tensor:
        if self.packed is not None and self._kernels is not None:
            features = 2 * self.shard if gate_up else self.hidden
            return packed_grouped_matmul(x, self.packed[0 if gate_up else 1], features, ends, self._kernels)
        out = grouped_matmul(x, self.w13 if gate_up else self.w2, ends)
        if gate_up and self.flashinfer.up_first:  # w13 is in the fused kernel's [up | gate] order
            out = out.roll(self.shard, dims=1)
        return out

    def expected_shards(self, param: str) -> set[object]:
        """The shard ids that must all load into `param` (the loader's completeness check)."""
        parts = (GATE, UP) if param == "w13" else (DOWN,)
        return {(e, p) for e in range(self.num_experts) for p in parts}

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        expert, part = cast("tuple[int, int]", shard)
        what = f"expert {expert} {('gate', 'up', 'down')[part]}"
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"{what}: the config has {self.num_experts} experts")
        s, start = self.shard, self.start
        if part == DOWN:
            target, dim, piece = self.w2.data[expert], 1, loaded[:, start : start + s]
        else:
            target, dim = self.w13.data[expert, part * s : (part + 1) * s], 0
            piece = loaded[start : start + s]
        if loaded.shape[dim] != self.intermediate:
            raise ValueError(f"{what}: checkpoint has {loaded.shape[dim]} features, the config {self.intermediate}")
        if tuple(piece.shape) != tuple(target.shape):
            raise ValueError(f"{what}: checkpoint shape {tuple(piece.shape)} != {tuple(target.shape)}")
        target.copy_(piece)

    def choose_kernel(self) -> bool:
        """Decide, once and outside graph capture, whether FlashInfer's fused
        kernel serves this layer (engine/loading.py calls it on CUDA)."""
        return self.packed is None and self.flashinfer.choose(self.w13.data, self.w2.data)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; each token's k experts `ids` [T, k] and their `weights`."""
        if self.packed is None:
            fused = self.flashinfer.run(x, weights, ids, self.w13.data, self.w2.data)
            if fused is not None:
                return all_reduce(fused)
        return all_reduce(routed_experts(x, weights, ids, self.num_experts, self._project))


class SparseMoeBlock(nn.Module):
    """Router and experts; in place of a dense MLP. The module names are
    Hugging Face's (`gate`, `experts`) so checkpoint names map directly."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, renormalize)
        self.experts = FusedMoE(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)
