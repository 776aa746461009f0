"""CUDA graphs for decode steps: launch a whole forward as one replay.

A decode step of a small model is ~1,100 kernel launches; from Python that
is 30-40 ms of host time for ~3 ms of GPU work. A captured graph replays
them all with one launch. Capture freezes every tensor address and shape,
so the runner owns static buffers (token ids, positions, KV slots and the
attention backend's page indices) for up to `max_bs` decodes, captures one
graph per batch size in `graph_batch_sizes(max_bs)`, and serves a decode
step of n requests by padding it to the next captured size, writing its
inputs into the buffers in place and replaying.

With LoRA adapters served, a second graph per batch size computes every
row's adapter update in the masked form (layers/lora.py): the rows' one-hot
slots are a static buffer like the token ids, written before each replay,
so one graph serves any mix of adapters; steps with none replay the plain
graph.

Padded rows are harmless dummies: token 0 at position 0, one KV token in
the reserved page 0, whose slot 0 they also write (page 0 is never handed
to a request, and padding elsewhere only ever reads it under a mask, so its
values need to be finite, not zero). Their hidden states are dropped.

The graph covers the transformer up to the final norm; the LM head runs
eagerly on the rows that sample, so that no graph holds a [bs, vocab]
output (151k floats a row for Qwen, 35 graphs) and sampling, whose shapes
vary with the requests' settings, stays as it is. Steps that prefill run
eagerly.

What captures is injected: `CudaGraphCapture` on CUDA, and `EagerCapture`
for the CPU tests, where "replay" reruns the step over the same buffers, so
the padding and the in-place updates are tested where CI runs.
"""

from __future__ import annotations

import bisect
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from aioserve.attention.backend import AttentionBackend, AttentionMetadata
from aioserve.batch_plan import BatchPlan
from aioserve.layers.lora import LoraRouting, LoraStepState

logger = logging.getLogger(__name__)

SCRATCH_SLOT = 0  # slot 0 of the reserved page 0: where padded rows write their K/V


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (max_bs itself included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_size(num_requests: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_requests`, None if none does."""
    i = bisect.bisect_left(sizes, num_requests)
    return sizes[i] if i < len(sizes) else None


def pad_decode_plan(plan: BatchPlan, batch_size: int) -> BatchPlan:
    """A decode-only host plan padded with dummy requests to `batch_size` rows
    (see the module doc); sampling is dropped (the rows that sample are the
    real ones, sampled outside the graph)."""
    if not plan.is_decode_only:
        raise ValueError("only decode-only plans replay a graph")
    n = plan.num_requests
    pad = batch_size - n
    if pad < 0:
        raise ValueError(f"{n} requests do not fit a graph of {batch_size}")

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((pad, *t.shape[1:]), value)])

    return replace(
        plan,
        input_ids=padded(plan.input_ids, 0),
        positions=padded(plan.positions, 0),
        out_cache_loc=padded(plan.out_cache_loc, SCRATCH_SLOT),
        seq_lens=padded(plan.seq_lens, 1),
        extend_lens=padded(plan.extend_lens, 1),
        page_table=padded(plan.page_table, 0),
        num_decodes=batch_size,
        logits_indices=torch.arange(batch_size),
        sampling=None,
        prompt_logprobs=None,
    )


class StepForward(Protocol):
    """What a graph captures: a forward over a step's rows (a CausalLM, or
    an adapter around a head that reads more than token ids)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


class StepReplay(Protocol):
    """A step run as one captured unit where it can: the graph runners here,
    the CPU's native DecoderStack (cpu_engine/decode_stack.py)."""

    def can_run(self, host_plan: BatchPlan) -> bool: ...

    def run(self, input_ids: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan) -> torch.Tensor: ...


def replaying(host_plan: BatchPlan, *runners: StepReplay | None) -> StepReplay | None:
    """The first of `runners` that serves this step; None: it runs eagerly."""
    return next((runner for runner in runners if runner is not None and runner.can_run(host_plan)), None)


class CapturedStep(Protocol):
    def replay(self) -> None: ...


class Capture(Protocol):
    def __call__(self, step: Callable[[], None]) -> CapturedStep: ...


@dataclass
class EagerStep:
    step: Callable[[], None]

    def replay(self) -> None:
        self.step()


class EagerCapture:
    """No graph: replay reruns the step (CPU tests of everything around capture)."""

    def __call__(self, step: Callable[[], None]) -> CapturedStep:
        return EagerStep(step)


class CudaGraphCapture:
    """torch.cuda graphs, all in one memory pool: captured largest first,
    each smaller graph fits in the blocks the larger ones freed."""

    def __init__(self) -> None:
        self.pool: torch.cuda._POOL_HANDLE | None = None

    def __call__(self, step: Callable[[], None]) -> CapturedStep:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        self.pool = graph.pool()
        return graph


@dataclass(frozen=True)
class GraphTarget:
    """What a runner captures over: a forward, the attention backend whose
    buffers it reads, and the static output's shape and place."""

    forward: StepForward
    attention: AttentionBackend
    width: int  # the forward's row width (its hidden size, or wider: engine.output_width)
    dtype: torch.dtype
    device: torch.device
    max_pages_per_request: int
    capture: Capture


class StepGraphRunner(ABC):
    """What the decode graphs and the verify graphs (engine/verify_graph.py)
    share: static row buffers for the largest captured batch, one graph per
    batch size, and a step served by padding it to the next captured size,
    writing its rows into the buffers in place and replaying."""

    kind = "step"  # for the log line

    def __init__(self, target: GraphTarget, max_bs: int, lora: tuple[LoraStepState, int] | None = None) -> None:
        """`lora`: the model's LoRA step state and its slot count, when adapters are served."""
        self.model = target.forward
        self.attention = target.attention
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.max_pages_per_request = target.max_pages_per_request
        device, dtype, capture = target.device, target.dtype, target.capture
        rows = self.rows(self.max_bs)
        long: dict[str, Any] = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.out_cache_loc = torch.full((rows,), SCRATCH_SLOT, **long)
        self.hidden = torch.zeros(rows, target.width, dtype=dtype, device=device)
        self._init_attention_buffers()
        self.lora_state = lora[0] if lora is not None else None
        # Each row's adapter slot, one-hot (see the module doc); padded rows all zero.
        self.lora_onehot = torch.zeros(rows, lora[1] if lora else 0, dtype=dtype, device=device)
        self.steps: dict[int, CapturedStep] = {}
        self.lora_steps: dict[int, CapturedStep] = {}
        self.replays = 0  # steps served by a graph
        on_cuda = device.type == "cuda"
        free_before = torch.cuda.mem_get_info(device)[0] if on_cuda else 0
        start = time.perf_counter()
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):
                self.steps[bs] = self._capture(bs, capture)
                if self.lora_state is not None:
                    self.lora_steps[bs] = self._capture(bs, capture, with_lora=True)
        self.capture_seconds = time.perf_counter() - start
        used = (free_before - torch.cuda.mem_get_info(device)[0]) if on_cuda else 0
        logger.info(
            "captured %s graphs for batch sizes %d..%d (%d graphs) in %.1f s, %.0f MiB",
            self.kind, self.batch_sizes[0], self.max_bs, len(self.batch_sizes), self.capture_seconds, used / 2**20,
        )

    # -- what a kind of step decides --------------------------------------------------

    @abstractmethod
    def rows(self, batch_size: int) -> int:
        """Token rows of the graph captured for `batch_size` requests."""

    @abstractmethod
    def _init_attention_buffers(self) -> None: ...

    @abstractmethod
    def _attention_metadata(self, batch_size: int) -> AttentionMetadata:
        """The attention backend's metadata over its static buffers (captured once per size)."""

    @abstractmethod
    def _padded(self, host_plan: BatchPlan, batch_size: int) -> BatchPlan:
        """The host plan padded to the graph of `batch_size`."""

    @abstractmethod
    def _update_attention(self, padded: BatchPlan) -> None:
        """Refill the backend's static buffers from a padded plan, before its replay."""

    @abstractmethod
    def can_run(self, host_plan: BatchPlan) -> bool: ...

    # -- shared -------------------------------------------------------------------------

    def _dummy_plan(self, batch_size: int) -> BatchPlan:
        """Every row padding: what the graphs are captured over."""
        empty = torch.zeros(0, dtype=torch.long)
        plan = BatchPlan(
            step=-1, input_ids=empty, positions=empty, out_cache_loc=empty, seq_lens=empty, extend_lens=empty,
            page_table=torch.zeros(0, 1, dtype=torch.int32), num_decodes=0, logits_indices=empty, sampling=None,
        )
        return self._padded(plan, batch_size)

    def _capture(self, bs: int, capture: Capture, with_lora: bool = False) -> CapturedStep:
        rows = self.rows(bs)
        meta = self._attention_metadata(bs)
        self._update_attention(self._dummy_plan(bs))
        ids, positions, hidden = self.input_ids[:rows], self.positions[:rows], self.hidden[:rows]
        state, routing = self.lora_state, LoraRouting([], onehot=self.lora_onehot[:rows])

        def step() -> None:
            if state is None or not with_lora:
                hidden.copy_(self.model(ids, positions, meta))
                return
            state.routing = routing  # set while the step runs: an eager replay reads it again
            try:
                hidden.copy_(self.model(ids, positions, meta))
            finally:
                state.routing = None

        step()  # warm-up outside the graph: lazy inits and autotuning must not be captured
        return capture(step)

    def run(self, input_ids: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan) -> torch.Tensor:
        """Hidden states [T, hidden] of a step `can_run` accepted: `input_ids`
        and `plan` on the device (placeholders resolved), `host_plan` its host copy."""
        n, t = host_plan.num_requests, host_plan.num_tokens
        bs = padded_size(n, self.batch_sizes)
        assert bs is not None and self.can_run(host_plan)
        rows = self.rows(bs)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(plan.positions, non_blocking=True)
        self.out_cache_loc[:t].copy_(plan.out_cache_loc, non_blocking=True)
        if rows > t:
            self.input_ids[t:rows].zero_()
            self.positions[t:rows].zero_()
            self.out_cache_loc[t:rows].fill_(SCRATCH_SLOT)
        self._update_attention(self._padded(host_plan, bs))
        if host_plan.lora is not None and host_plan.lora.uses_adapters:
            # A row per request (decodes): the request's slot, one-hot.
            onehot = torch.zeros(rows, self.lora_onehot.shape[1], dtype=self.lora_onehot.dtype)
            onehot[torch.arange(n), host_plan.lora.request_slots] = 1
            self.lora_onehot[:rows].copy_(onehot, non_blocking=True)
            self.lora_steps[bs].replay()
            self.replays += 1
            return self.hidden[:t]
        self.steps[bs].replay()
        self.replays += 1
        return self.hidden[:t]


class DecodeGraphRunner(StepGraphRunner):
    """Decode-only steps: a row per request."""

    kind = "decode"

    def rows(self, batch_size: int) -> int:
        return batch_size

    def _init_attention_buffers(self) -> None:
        self.attention.init_graph_buffers(self.max_bs, self.max_pages_per_request)

    def _attention_metadata(self, batch_size: int) -> AttentionMetadata:
        return self.attention.graph_metadata(batch_size, self.out_cache_loc[:batch_size])

    def _padded(self, host_plan: BatchPlan, batch_size: int) -> BatchPlan:
        return pad_decode_plan(host_plan, batch_size)

    def _update_attention(self, padded: BatchPlan) -> None:
        self.attention.update_graph_buffers(padded)

    def can_run(self, host_plan: BatchPlan) -> bool:
        return (
            host_plan.is_decode_only
            and not host_plan.has_image_rows
            and host_plan.num_requests <= self.max_bs
            and host_plan.prompt_logprobs is None
            and (host_plan.lora is None or not host_plan.lora.uses_adapters or bool(self.lora_steps))
        )
