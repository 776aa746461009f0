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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from aioserve.attention.backend import AttentionBackend
from aioserve.batch_plan import BatchPlan
from aioserve.layers.lora import LoraRouting, LoraStepState
from aioserve.models.causal_lm import CausalLM

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


class DecodeGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_bs: int,
        max_pages_per_request: int,
        capture: Capture,
        lora: tuple[LoraStepState, int] | None = None,
    ) -> None:
        """`lora`: the model's LoRA step state and its slot count, when adapters are served."""
        self.model = model
        self.attention = attention
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        long: dict[str, Any] = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(self.max_bs, **long)
        self.positions = torch.zeros(self.max_bs, **long)
        self.out_cache_loc = torch.full((self.max_bs,), SCRATCH_SLOT, **long)
        self.hidden = torch.zeros(self.max_bs, hidden_size, dtype=dtype, device=device)
        attention.init_graph_buffers(self.max_bs, max_pages_per_request)
        self.lora_state = lora[0] if lora is not None else None
        # Each row's adapter slot, one-hot (see the module doc); padded rows all zero.
        self.lora_onehot = torch.zeros(self.max_bs, lora[1] if lora else 0, dtype=dtype, device=device)
        self.steps: dict[int, CapturedStep] = {}
        self.lora_steps: dict[int, CapturedStep] = {}
        self.replays = 0  # decode steps served by a graph
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
            "captured decode graphs for batch sizes %d..%d (%d graphs) in %.1f s, %.0f MiB",
            self.batch_sizes[0], self.max_bs, len(self.batch_sizes), self.capture_seconds, used / 2**20,
        )

    def _dummy_plan(self, batch_size: int) -> BatchPlan:
        """Every row padding: what the graphs are captured over."""
        empty = torch.zeros(0, dtype=torch.long)
        plan = BatchPlan(
            step=-1, input_ids=empty, positions=empty, out_cache_loc=empty, seq_lens=empty, extend_lens=empty,
            page_table=torch.zeros(0, 1, dtype=torch.int32), num_decodes=0, logits_indices=empty, sampling=None,
        )
        return pad_decode_plan(plan, batch_size)

    def _capture(self, bs: int, capture: Capture, with_lora: bool = False) -> CapturedStep:
        meta = self.attention.graph_metadata(bs, self.out_cache_loc[:bs])
        self.attention.update_graph_buffers(self._dummy_plan(bs))
        ids, positions, hidden = self.input_ids[:bs], self.positions[:bs], self.hidden[:bs]
        state, routing = self.lora_state, LoraRouting([], onehot=self.lora_onehot[:bs])

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

    def can_run(self, host_plan: BatchPlan) -> bool:
        return (
            host_plan.is_decode_only
            and not host_plan.has_image_rows
            and host_plan.num_requests <= self.max_bs
            and host_plan.prompt_logprobs is None
            and (host_plan.lora is None or not host_plan.lora.uses_adapters or bool(self.lora_steps))
        )

    def run(self, input_ids: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step: `input_ids` and
        `plan` on the device (placeholders resolved), `host_plan` its host copy."""
        n = host_plan.num_requests
        bs = padded_size(n, self.batch_sizes)
        assert bs is not None and self.can_run(host_plan)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(plan.positions, non_blocking=True)
        self.out_cache_loc[:n].copy_(plan.out_cache_loc, non_blocking=True)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_cache_loc[n:bs].fill_(SCRATCH_SLOT)
        self.attention.update_graph_buffers(pad_decode_plan(host_plan, bs))
        if host_plan.lora is not None and host_plan.lora.uses_adapters:
            onehot = torch.zeros(bs, self.lora_onehot.shape[1], dtype=self.lora_onehot.dtype)
            onehot[torch.arange(n), host_plan.lora.request_slots] = 1
            self.lora_onehot[:bs].copy_(onehot, non_blocking=True)
            self.lora_steps[bs].replay()
            self.replays += 1
            return self.hidden[:n]
        self.steps[bs].replay()
        self.replays += 1
        return self.hidden[:n]
