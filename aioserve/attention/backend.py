"""The attention backend interface.

A backend turns a batch plan into metadata once per step (`prepare`); every
layer then calls `metadata.attend`, which stores the step's new keys and
values into the pool and attends over each request's cached prefix plus its
new tokens. The model hands the metadata down as an argument: no layer
reaches up for a global "current batch".

A backend whose decode kernel reads every length from device tensors can
also serve CUDA-graph replay (engine/cuda_graph.py): it then keeps static
buffers for up to `max_bs` decodes, hands out metadata built on them for
capture, and refills them from each padded decode plan before a replay.
One whose extend kernel reads its query offsets from device buffers as well
can serve verify graphs (engine/verify_graph.py): steps whose requests each
add a few tokens (a speculative verification, decodes beside it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from aioserve.batch_plan import BatchPlan


@dataclass(frozen=True)
class KVDestination:
    """Where a step's new keys and values of one layer go: the pool's
    [slots, Hk, D] keys and values, and each token's slot."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor  # [T] int64


class AttentionMetadata(ABC):
    @abstractmethod
    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        scale: float,
        sliding_window: int | None,
        stored: bool = False,  # the layer wrote k and v to kv_destination(layer) itself
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

    def kv_destination(self, layer: int) -> KVDestination | None:
        """Where `layer`'s keys and values go this step, for a layer that
        writes them itself (fused with RoPE: flashinfer/qk_rope_store.py) and
        then calls `attend(..., stored=True)`; None: `attend` stores them."""
        return None

    def native_kv_destination(self, layer: int) -> KVDestination | None:
        """The same, for a CPU layer whose keys and values the native
        qk_norm_rope_store writes (cpu/native_ops.py), leaving k rotated in
        place for this step's prompt attention; None: not on this backend."""
        return None


class AttentionBackend(ABC):
    name: str  # as --attention-backend spells it

    @abstractmethod
    def prepare(self, plan: BatchPlan, host_plan: BatchPlan) -> AttentionMetadata:
        """Per-step work shared by all layers (index tensors, masks, plans).
        `plan` is on the engine's device; `host_plan` is the same plan on the
        CPU, for lengths the backend must know without a device sync."""

    # -- CUDA-graph hooks: only for backends with `supports_graphs` ----------------

    @property
    def supports_graphs(self) -> bool:
        """Whether decode reads every length from device buffers, so a graph
        captured once replays any batch (a class attribute where it is fixed)."""
        return False

    def init_graph_buffers(self, max_bs: int, max_pages_per_request: int) -> None:
        """Allocate the static buffers every captured batch size slices."""
        raise NotImplementedError(f"{type(self).__name__} has no CUDA-graph support")

    def graph_metadata(self, batch_size: int, out_cache_loc: torch.Tensor) -> AttentionMetadata:
        """Metadata over the static buffers for a decode batch of `batch_size`
        (captured once; `out_cache_loc` is the runner's static slot buffer)."""
        raise NotImplementedError(f"{type(self).__name__} has no CUDA-graph support")

    def update_graph_buffers(self, host_plan: BatchPlan) -> None:
        """Fill the static buffers from a decode-only plan already padded to a
        captured size (on the host: no device sync), before its replay."""
        raise NotImplementedError(f"{type(self).__name__} has no CUDA-graph support")

    # -- verify graphs: only for backends with `supports_verify_graphs` -----------------

    @property
    def supports_verify_graphs(self) -> bool:
        """Whether an extend step reads its query offsets and KV lengths from
        device buffers, so a graph captured once replays any step of at most
        the captured requests and rows."""
        return False

    def init_verify_graph_buffers(self, max_requests: int, max_pages: int) -> None:
        """Allocate the static buffers every verify graph slices (`max_pages`: all requests' together)."""
        raise NotImplementedError(f"{type(self).__name__} has no verify-graph support")

    def verify_graph_metadata(self, num_requests: int, out_cache_loc: torch.Tensor) -> AttentionMetadata:
        """Metadata over the static buffers for an extend step of `num_requests`
        (padding requests included) over `out_cache_loc`'s rows, every request causal."""
        raise NotImplementedError(f"{type(self).__name__} has no verify-graph support")

    def update_verify_graph_buffers(self, host_plan: BatchPlan) -> None:
        """Fill the static buffers from a plan padded to a captured verify
        graph (every request an extend of the captured rows in all)."""
        raise NotImplementedError(f"{type(self).__name__} has no verify-graph support")


@dataclass(frozen=True)
class AttentionShape:
    """What a backend must know of the model before the first step."""

    num_qo_heads: int  # per rank
    num_kv_heads: int  # per rank
    head_dim: int
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    q_dtype: torch.dtype
    sm_scale: float | None = None  # every layer's softmax scale; None: head_dim ** -0.5
    # False for encoders (BERT, XLM-R): each token attends to every token of
    # its sequence. See check_non_causal_plan for what such a plan must be.
    causal: bool = True


def check_non_causal_plan(plan: BatchPlan) -> None:
    """Bidirectional attention is only right over a whole sequence: a token
    early in the prompt attends to later ones, so a request cut into chunks
    (a later chunk has a prefix) or started on a cached prefix would attend
    to keys that were computed without seeing it, or never see its own
    later tokens. An encoder request must arrive whole, in one step, from
    position 0; this refuses a plan that breaks that, on the host plan.
    (A first chunk looks like a whole prompt here: the scheduler must never
    chunk an encoder's prompt; its next chunk would be refused.)"""
    seq_lens = plan.seq_lens.tolist()
    extend_lens = plan.extend_lens.tolist()
    for i, (total, new) in enumerate(zip(seq_lens, extend_lens)):
        if total != new:
            raise ValueError(
                f"non-causal attention: request {i} of the step has {new} new tokens after {total - new} "
                "already in the KV cache (a chunked prompt or a cached prefix); an encoder's request must "
                "arrive whole, in one step, from position 0"
            )
