"""Speculative decoding's draft model, run inside the engine's step.

The draft has its own KV pool with the target's page geometry (as many
pages, of the same size; its own layers, heads, head_dim): a page id names
the same positions in both pools, so the scheduler's one KVManager
allocates, caches, evicts and frees for both, and the draft reads a
request's KV through the plan's own page table.

Two things happen each step, both on the engine's thread:

* `propose`: for the plan's DraftBatch (verifications planned with
  placeholder rows), k batched greedy decodes of the draft, the newest
  token giving d1, d1 giving d2, and so on; the proposals are written into
  the step's input ids where the placeholders were.
* `follow`: the draft runs over the whole plan (its input ids, positions,
  slots), so that its KV holds every position the target's does: prompt
  chunks, plain decodes, and a verification's k + 1 positions (the decodes
  above stored all but the last proposal's; positions past what the target
  accepts are overwritten later, as the target's are). Prefix-cache pages
  were written by both models, since every step ran through both.

With CUDA graphs (`capture_graphs`, FlashInfer) the draft replays graphs
of its own, over its own pool and attention buffers: decode graphs for its
proposals' decodes and for following decode-only steps, verify graphs
(engine/verify_graph.py) for following speculating steps; anything else
(prompt chunks) runs eagerly. Eager, the model as its own draft ran at
0.14x of plain decoding on an H200: k + 1 eager forwards a step.
"""

from __future__ import annotations

import logging

import torch

from aioserve.attention import create_backend
from aioserve.batch_plan import BatchPlan, DraftBatch
from aioserve.engine.cuda_graph import Capture, DecodeGraphRunner, GraphTarget, replaying
from aioserve.engine.draft_model import LoadedDraft
from aioserve.engine.rank_attention import rank_attention_shape
from aioserve.engine.verify_graph import VerifyGraphRunner
from aioserve.kvcache.kv_pool import KVPool

logger = logging.getLogger(__name__)


class DraftRunner:
    def __init__(
        self, draft: LoadedDraft, num_pages: int, page_size: int, kv_dtype: torch.dtype, q_dtype: torch.dtype,
        attention_backend: str, device: torch.device, tp_size: int = 1,
    ) -> None:
        mc = draft.model_config
        self.model = draft.model
        self.device = device
        self.dtype = q_dtype
        self.hidden_size = mc.hidden_size
        self.decode_graphs: DecodeGraphRunner | None = None
        self.verify_graphs: VerifyGraphRunner | None = None
        # Under tensor parallelism the draft is sharded like the target (its
        # layers read the same group): each rank holds its share of the heads.
        self.attention_shape = shape = rank_attention_shape(mc, tp_size, q_dtype)
        self.pool = KVPool(mc.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, kv_dtype, device)
        self.attention = create_backend(attention_backend, self.pool, shape)

    @property
    def pool_bytes(self) -> int:
        return self.pool.buffer.numel() * self.pool.buffer.element_size()

    def capture_graphs(
        self, capture: Capture, max_bs: int, max_pages_per_request: int, verify_max_bs: int, tokens_per_request: int,
    ) -> None:
        """The draft's CUDA graphs, where its attention backend can replay
        (the target's sizes: `max_bs` decodes, verify graphs of
        `verify_max_bs` requests of `tokens_per_request` rows)."""
        if not self.attention.supports_graphs:
            return
        target = GraphTarget(self.model, self.attention, self.hidden_size, self.dtype, self.device, max_pages_per_request,
                             capture)
        self.decode_graphs = DecodeGraphRunner(target, max_bs)
        if self.attention.supports_verify_graphs:
            self.verify_graphs = VerifyGraphRunner(target, verify_max_bs, tokens_per_request, self.pool.page_size)

    def _forward(self, input_ids: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan) -> torch.Tensor:
        """The draft's hidden states for a step: a graph's replay where one serves it, else eagerly."""
        replay = replaying(host_plan, self.decode_graphs, self.verify_graphs)
        if replay is not None:
            return replay.run(input_ids, plan, host_plan)
        return self.model(input_ids, plan.positions, self.attention.prepare(plan, host_plan))

    def propose(self, host_plan: BatchPlan, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's proposals [D] (DraftBatch order) and a copy of
        `input_ids` (the step's, on the device) with them in the placeholders' rows."""
        batch = host_plan.draft
        assert batch is not None
        proposals = torch.zeros(batch.num_tokens, dtype=torch.long, device=self.device)
        offsets = batch.offsets
        starts = newest_positions(host_plan, batch)
        newest = input_ids[upload(batch.first_rows, self.device)]  # decode i's input: the newest token, then d_i
        for i in range(max(batch.lengths)):
            active = [j for j, length in enumerate(batch.lengths) if length > i]
            every = len(active) == len(batch.lengths)
            chosen = None if every else upload(active, self.device)
            decode = decode_plan(host_plan, batch, active, starts, i)
            hidden = self._forward(newest if chosen is None else newest[chosen], decode.to(self.device), decode)
            # Greedy: a top-1 chain, as vLLM's and SGLang's drafts by default.
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            proposals[upload([offsets[j] + i for j in active], self.device)] = tokens
            newest = tokens if chosen is None else newest.index_copy(0, chosen, tokens)
        return proposals, with_proposals(batch, input_ids, proposals)

    def follow(self, plan: BatchPlan, host_plan: BatchPlan, input_ids: torch.Tensor) -> None:
        """Run the draft over the whole step, for its KV (its logits are not needed)."""
        self._forward(input_ids, plan, host_plan)


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """Host indices on the device without waiting for the stream (through
    pinned memory, as plans are moved: batch_plan._move)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def newest_positions(host_plan: BatchPlan, batch: DraftBatch) -> list[int]:
    """Each verification's first position: where its newest token sits."""
    return [int(host_plan.seq_lens[r]) - int(host_plan.extend_lens[r]) for r in batch.requests]


def with_proposals(batch: DraftBatch, input_ids: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """A copy of the step's `input_ids` with `proposals` (DraftBatch order)
    in the placeholders' rows, the rows after each entry's newest token."""
    rows = [first + 1 + i for first, length in zip(batch.first_rows, batch.lengths) for i in range(length)]
    filled = input_ids.clone()
    filled[upload(rows, input_ids.device)] = proposals
    return filled


def decode_plan(host_plan: BatchPlan, batch: DraftBatch, active: list[int], starts: list[int], i: int) -> BatchPlan:
    """A draft's i-th decode of the `active` entries: the token at position
    start + i of each, into the KV slot the plan gives that position's row
    (the draft's pool shares the target's page ids)."""
    requests = [batch.requests[j] for j in active]
    rows = [batch.first_rows[j] + i for j in active]
    positions = torch.tensor([starts[j] + i for j in active], dtype=torch.long)
    n = len(active)
    return BatchPlan(
        step=host_plan.step,
        input_ids=torch.zeros(n, dtype=torch.long),  # the tokens are on the device (`propose` passes them)
        positions=positions,
        out_cache_loc=host_plan.out_cache_loc[rows],
        seq_lens=positions + 1,
        extend_lens=torch.ones(n, dtype=torch.long),
        page_table=host_plan.page_table[requests],
        num_decodes=n,
        logits_indices=torch.arange(n),
        sampling=None,
    )
