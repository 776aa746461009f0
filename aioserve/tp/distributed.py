"""Tensor-parallel group: which shard this process holds, and its collectives.

The group is process-wide state set once at start-up (one process per rank),
read by the layers when they size their weight shards. With one rank every
collective is the identity, so the single-process path has no comms at all.

Two process groups back it:
* the *device* group (NCCL on CUDA, gloo on CPU) carries the tensors of a
  step: row-parallel all-reduces, the vocab-parallel gathers, the sampled
  tokens. A collective that waits longer than STEP_TIMEOUT is an error.
* the *host* group (always gloo) carries small CPU-side data: the batch plan
  broadcast, start-up agreement. An idle follower waits in it for the next
  plan for as long as the server is idle, so its timeout is effectively
  infinite; a rank that dies is noticed by the lifeline (tp/lifeline.py),
  not by a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STEP_TIMEOUT = timedelta(minutes=10)
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


_tp = TPGroup()
_host_group: Any = None  # the gloo group of the plan broadcast (None at one rank)


def get_tp_group() -> TPGroup:
    return _tp


@contextlib.contextmanager
def tp_group_as(group: TPGroup) -> Iterator[None]:
    """Build layers with the shard shapes of `group` in this process, without
    joining any process group: for tests and tools that inspect one rank's
    shard. Collectives must not run inside."""
    global _tp
    previous, _tp = _tp, group
    try:
        yield
    finally:
        _tp = previous


def init_tensor_parallel(rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
    """Join the process groups of `size` ranks that meet at `store`."""
    global _tp, _host_group
    if size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL allocates on the current device
        backend = "nccl" if device.type == "cuda" else "gloo"
        options: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=STEP_TIMEOUT, **options)
        _host_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        logger.info("rank %d/%d joined the tensor-parallel group (%s + gloo)", rank, size, backend)
    _tp = TPGroup(rank=rank, size=size)
    return _tp


def destroy_tensor_parallel() -> None:
    global _tp, _host_group
    if _tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _tp, _host_group = TPGroup(), None


# -- the step's tensors (device group) -----------------------------------------


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


def broadcast_from_leader(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place (the sampled tokens). On CUDA it
    is enqueued on the current stream: the host does not wait."""
    if _tp.size > 1:
        dist.broadcast(x, src=0)
    return x


# -- CPU-side data (host group) -------------------------------------------------


def host_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's CPU tensor `x` on every rank, in place; followers block here
    (without spinning) until rank 0 sends."""
    dist.broadcast(x, src=0, group=_host_group)
    return x


def min_over_ranks(value: int) -> int:
    """The smallest `value` any rank holds (what every rank can afford)."""
    if _tp.size == 1:
        return value
    x = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(x, op=dist.ReduceOp.MIN, group=_host_group)
    return int(x.item())


def gather_from_ranks(obj: Any) -> list[Any]:
    """Every rank's `obj` (plain picklable data), in rank order, on every rank.
    Start-up only: ranks are one trusted program, so pickle is acceptable."""
    if _tp.size == 1:
        return [obj]
    blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(_tp.size)]
    dist.all_gather(sizes, torch.tensor([blob.numel()]), group=_host_group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: blob.numel()] = blob
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(_tp.size)]
    dist.all_gather(parts, padded, group=_host_group)
    return [pickle.loads(p[: int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]


# -- how things are split ---------------------------------------------------------


def shard_range(total: int, tp: TPGroup | None = None) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `total` (which must divide)."""
    tp = tp or _tp
    if total % tp.size:
        raise ValueError(f"{total} does not divide evenly over {tp.size} ranks")
    per_rank = total // tp.size
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads on each rank: an even share, or one replicated head per rank
    when there are fewer KV heads than ranks. Other splits would give a rank
    query heads of two KV heads it does not both hold."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not divide evenly over {tp_size} ranks")
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} ranks do not divide evenly over {num_kv_heads} KV heads (to replicate them)")
    return 1
