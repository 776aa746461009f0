"""Linear layers whose weights are split over the tensor-parallel ranks.

Each layer knows how to cut its own shard out of a full Hugging Face tensor
(`load_weight`), so the weight loader stays a plain name-mapping loop. What
it is handed may be a tensor or the loader's lazy CheckpointTensor: layers
only index it (`loaded[a:b]`, `loaded[:, a:b]`, `loaded[:]`) and read
`.shape`, so each rank reads just its slice from the file.
Column-parallel layers split the output features and need no comms;
row-parallel layers split the input features and all-reduce their output.

A layer may hold its weight quantised (FP8 with its scales): the
checkpoint's quantisation method (quant/) sets it up before loading and
gives it a `LinearQuant`, which its forward asks for the product. That is
the layers' one seam with quant/: they know no format.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from aioserve.tp.distributed import all_reduce, get_tp_group, kv_heads_per_rank, shard_range
from aioserve.cpu.matmul import MatmulChoice, cpu_matmul
from aioserve.layers.lora import LoraSlots


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    choice: MatmulChoice | None = None,
    float_out: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ b). On CPU by the form tuned for this weight, or its packed
    kernel (cpu_matmul.py). `float_out`: float32 is welcome; `out`: a
    destination the packed kernel may write into (both: see cpu_matmul)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, choice, float_out).view(*x.shape[:-1], -1)
    return cpu_matmul(x, weight, choice, bias, float_out, out)


def _check_full(loaded: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """The checkpoint tensor (before slicing) has the size the config implies
    along the split dim: a slice of a wrong-sized tensor could look right."""
    if loaded.shape[dim] != expected:
        raise ValueError(f"{what}: checkpoint has {loaded.shape[dim]} features along dim {dim}, the config {expected}")


def _weight_or_bias(layer: nn.Module, name: str) -> nn.Parameter:
    """The parameter a checkpoint tensor loads into (weight, bias, or a
    quantised weight's per-row weight_scale); a checkpoint holds a bias only
    for layers the config builds with one."""
    return cast(nn.Parameter, getattr(layer, name))


class LinearQuant(Protocol):
    """How a layer holding a quantised weight multiplies (quant/: FP8 with
    its scales per row or per block): given to the layer before loading."""

    def apply(self, layer: QuantizableLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class QuantizableLinear(nn.Module):
    """A linear layer whose weight may be held quantised: then `quant` is
    set, `weight` holds the stored values and `weight_scale` their scales
    (both laid out by quant/); else `quant` is None and the weight is wide."""

    weight: nn.Parameter
    weight_scale: nn.Parameter | None
    matmul_choice: MatmulChoice | None
    quant: LinearQuant | None = None
    in_features: int  # this rank's
    out_features: int
    lora: LoraSlots | None = None  # its LoRA adapters' slots, when adapters are served (layers/lora.py)

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        """Copy this rank's part of a checkpoint tensor into parameter `name` (each kind cuts its own)."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b), this rank's part: by the quantised form when there is
        one; plus each row's adapter update (before a row-parallel layer's
        all-reduce: the partial updates sum like the partial products)."""
        if self.quant is not None:
            y = self.quant.apply(self, x, bias)
        else:
            y = linear(x, self.weight, bias, self.matmul_choice)
        return y if self.lora is None else self.lora.add_to(x, y)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """`loaded` is the already-sliced tensor."""
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T + b with W's rows (output features) split over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.out_full = out_features
        self.out_start, out_end = shard_range(out_features)
        # This rank's sizes (the weight's shape may change when packed for a CPU kernel).
        self.in_features, self.out_features = in_features, out_end - self.out_start
        self.weight = nn.Parameter(torch.empty(out_end - self.out_start, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_end - self.out_start), requires_grad=False) if bias else None
        self.register_parameter("weight_scale", None)  # a quantised weight's scales (quant/)
        self.matmul_choice: MatmulChoice | None = None  # set by tune_cpu_matmuls or pack_cpu_weights

    def part_rows(self, shard: object) -> tuple[int, int, int, int]:
        """Where part `shard` goes: (its first row in this rank's weight, its
        rows here, its first row in the checkpoint tensor, that tensor's rows)."""
        return 0, self.weight.shape[0], self.out_start, self.out_full

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        offset, size, start, full = self.part_rows(shard)
        what = name if shard is None else f"{name}[{shard}]"
        _check_full(loaded, 0, full, what)
        copy_checked(_weight_or_bias(self, name)[offset : offset + size], loaded[start : start + size], what)

    def block_boundaries(self) -> list[int]:
        """Its columns, and where each part starts and ends in this rank's
        weight and in the checkpoint tensor. A weight held in 128 x 128
        blocks needs all of them on a block boundary, so each part's scales
        are whole rows of the checkpoint's scale grid."""
        parts = [self.part_rows(shard) for shard in getattr(self, "shard_ids", (None,))]
        return [self.weight.shape[1]] + [v for offset, size, start, _ in parts for v in (offset, size, start)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one
    matmul (gate and up of the MLP). Each part is split over ranks on its own,
    so a rank holds [gate shard | up shard]."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        tp = get_tp_group()
        for size in part_sizes:
            if size % tp.size:
                raise ValueError(f"a projection of {size} features does not divide over {tp.size} ranks")
        self.part_sizes = [size // tp.size for size in part_sizes]
        self.shard_ids = tuple(range(len(part_sizes)))
        self.full_part_sizes = part_sizes
        super().__init__(in_features, sum(part_sizes), bias)

    def part_rows(self, shard: object) -> tuple[int, int, int, int]:
        index = int(cast(int, shard))  # the part's number (weight_loader._FUSED_PARTS)
        start, _ = shard_range(self.full_part_sizes[index])
        return sum(self.part_sizes[:index]), self.part_sizes[index], start, self.full_part_sizes[index]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one matmul, split by attention head.

    When there are fewer KV heads than ranks, each KV head is replicated on
    the ranks whose query heads use it.
    """

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_group()
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not divide over {tp.size} ranks")
        self.head_dim = head_dim
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        # The first KV head this rank holds (replicated when kv heads < ranks).
        self.kv_head_start = (tp.rank * num_kv_heads) // tp.size
        nn.Module.__init__(self)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.in_features, self.out_features = hidden, out
        self.q_head_start = tp.rank * self.num_heads
        self.weight = nn.Parameter(torch.empty(out, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.register_parameter("weight_scale", None)  # a quantised weight's scales (quant/)
        self.matmul_choice: MatmulChoice | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def part_rows(self, shard: object) -> tuple[int, int, int, int]:
        d = self.head_dim
        if shard == "q":
            return 0, self.q_size, self.q_head_start * d, self.total_heads * d
        if shard in ("k", "v"):
            offset = self.q_size + (0 if shard == "k" else self.kv_size)
            return offset, self.kv_size, self.kv_head_start * d, self.total_kv_heads * d
        raise ValueError(f"unknown qkv shard {shard!r}")


class ReplicatedLinear(nn.Module):
    """y = x W^T + b with W whole on every rank: small heads (an encoder's
    pooler and classifier) that every rank computes alike, with no
    collective. Never quantised: a checkpoint's quantisation covers the
    transformer's projections, not a classifier of a few outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        copy_checked(_weight_or_bias(self, name), loaded[:], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(QuantizableLinear):
    """y = x W^T + b with W's columns (input features) split over ranks; the
    partial products are summed across ranks, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_full = in_features
        self.in_start, in_end = shard_range(in_features)
        self.in_features, self.out_features = in_end - self.in_start, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_end - self.in_start), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.register_parameter("weight_scale", None)  # a quantised weight's scales (quant/)
        self.matmul_choice: MatmulChoice | None = None

    def load_weight(self, name: str, loaded: torch.Tensor, shard: object = None) -> None:
        if name in ("bias", "weight_scale"):  # over the output rows, which this layer does not split
            copy_checked(_weight_or_bias(self, name), loaded[:], name)
            return
        cols = self.weight.shape[1]
        _check_full(loaded, 1, self.in_full, name)
        copy_checked(self.weight, loaded[:, self.in_start : self.in_start + cols], name)

    def block_boundaries(self) -> list[int]:
        """Its rows and its columns' span in the checkpoint tensor (see ColumnParallelLinear's)."""
        return [self.weight.shape[0], self.weight.shape[1], self.in_start]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x))
        return y + self.bias if self.bias is not None else y
