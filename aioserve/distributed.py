"""Tensor-parallel group: which shard this process holds, and its collectives.

The group is process-wide state set once at start-up (one process per rank),
read by the layers when they size their weight shards. With one rank every
collective is the identity, so the single-process path has no comms at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


_tp = TPGroup()


def get_tp_group() -> TPGroup:
    return _tp


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str) -> TPGroup:
    """Join the process group of `size` ranks (gloo on CPU, nccl on CUDA)."""
    global _tp
    if size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        logger.info("rank %d/%d joined the tensor-parallel group (%s)", rank, size, backend)
    _tp = TPGroup(rank=rank, size=size)
    return _tp


def destroy_tensor_parallel() -> None:
    global _tp
    if _tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _tp = TPGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks (row-parallel outputs, vocab-parallel embeddings)."""
    if _tp.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's `x` along the last dim (vocab-parallel logits)."""
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def shard_range(total: int, tp: TPGroup | None = None) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `total` (which must divide)."""
    tp = tp or _tp
    if total % tp.size:
        raise ValueError(f"{total} does not divide evenly over {tp.size} ranks")
    per_rank = total // tp.size
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads on each rank: an even share, or one replicated head per rank
    when there are fewer KV heads than ranks."""
    return max(1, num_kv_heads // tp_size)
