"""Speculative decoding's EAGLE-3 head, run inside the engine's step.

The head's draft position i pairs the target's hidden states at position i
with the token at position i + 1 (models/eagle3.py), so the head lags the
target by one token. Two things happen each step, both on the engine's
thread:

* `follow`, after the target's forward and sampling: the head runs over
  every row of the plan, row i fed the target's three hidden states there
  and the token that follows it: the next prompt token where the prompt
  names it (BatchPlan.following_ids), else the token the target just
  sampled at that row (a decode, a prompt's last row, every row of a
  verification: whichever of those the scheduler keeps, the token kept
  after it is the target's sample there). This writes the head's KV; and at
  each sampled row the head's proposal for the token after the sampled one
  and its pre-norm hidden state are kept per KV slot (`next_token`,
  `hidden`): the state a draft starts from.
* `propose`, before the target's forward, for the plan's DraftBatch: entry
  j's newest token sits at position p; the state at position p - 1's slot
  (written by the follow of the step that sampled that token) gives the
  first proposal d1 and the hidden state to feed back; k - 1 batched
  decodes of the head at positions p .. p + k - 2 give d2 .. dk, each fed
  its own previous pre-norm output (the target's states for those
  positions do not exist yet). The proposals fill the placeholders' rows.
  Their KV is overwritten by this step's follow with the target's states.

Verified rows past what the scheduler accepts leave KV and slot state that
nothing reads (the next draft starts at the last accepted row's slot) until
later steps overwrite them, as the target's own KV there. A prefix-cache
hit reuses the head's KV with the target's; the head's entry at a cached
prefix's last position paired it with the token that followed it when it
was computed, which may differ for the new request: only the proposals'
quality can suffer, never the output (the target verifies every token).

With CUDA graphs (`capture_graphs`, FlashInfer) the head replays graphs of
its own over its pool: decode graphs for the proposal decodes and for
following decode-only steps, verify graphs for following verifications. A
graph reads token ids, so the state each row is fed comes through a static
buffer (`HeadForward`), one width for both uses: a follow applies the
head's `fc` to the target's three states first, eagerly, which the head
would otherwise do itself. Under tensor parallelism its layer is sharded
like the target's.
"""

from __future__ import annotations

import logging

import torch

from aioserve.attention import create_backend
from aioserve.attention.backend import AttentionMetadata
from aioserve.batch_plan import BatchPlan
from aioserve.engine.cuda_graph import Capture, DecodeGraphRunner, GraphTarget, replaying
from aioserve.engine.draft_runner import decode_plan, newest_positions, upload, with_proposals
from aioserve.engine.eagle3_draft import LoadedEagle3
from aioserve.engine.rank_attention import rank_attention_shape
from aioserve.engine.verify_graph import VerifyGraphRunner, verify_rows
from aioserve.kvcache.kv_pool import KVPool
from aioserve.layers.embedding import VocabParallelEmbedding
from aioserve.models.eagle3 import Eagle3Head

logger = logging.getLogger(__name__)


class HeadForward:
    """The head as a graph captures a forward: token ids in, its two outputs
    side by side out ([T, 2H]: normed, pre-norm), the state each row is fed
    read from `fed` [rows, H], which the caller fills before a replay."""

    def __init__(self, head: Eagle3Head, embed: VocabParallelEmbedding, fed: torch.Tensor) -> None:
        self.head, self.embed, self.fed = head, embed, fed

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        normed, prenorm = self.head(self.embed(input_ids), positions, self.fed[: input_ids.shape[0]], meta)
        return torch.cat([normed, prenorm], dim=-1)


class Eagle3Runner:
    def __init__(
        self, loaded: LoadedEagle3, embed: VocabParallelEmbedding, num_pages: int, page_size: int,
        kv_dtype: torch.dtype, dtype: torch.dtype, attention_backend: str, device: torch.device,
        tp_size: int = 1,
    ) -> None:
        layer = loaded.config.layer
        self.head = loaded.head
        self.embed = embed  # the target's embedding table: the head has none of its own
        self.aux_layers = loaded.aux_layers
        self.page_size = page_size
        self.device = device
        # Under tensor parallelism the head's layer is split like the target's
        # (its parallel linears read the same group): this rank's KV heads.
        self.attention_shape = rank_attention_shape(layer, tp_size, dtype, sliding_windows=(None,))
        self.pool = KVPool(1, num_pages, page_size, self.attention_shape.num_kv_heads, layer.head_dim, kv_dtype, device)
        self.attention = create_backend(attention_backend, self.pool, self.attention_shape)
        slots = num_pages * page_size
        self.next_token = torch.zeros(slots, dtype=torch.long, device=device)
        self.hidden = torch.zeros(slots, layer.hidden_size, dtype=dtype, device=device)
        self.dtype = dtype
        self.decode_graphs: DecodeGraphRunner | None = None
        self.verify_graphs: VerifyGraphRunner | None = None
        self.fed = torch.zeros(0, layer.hidden_size, dtype=dtype, device=device)  # the graphs' fed states

    def capture_graphs(
        self, capture: Capture, max_bs: int, max_pages_per_request: int, verify_max_bs: int, tokens_per_request: int,
    ) -> None:
        """The head's CUDA graphs, where its attention backend can replay
        (the target's sizes, as a draft model's)."""
        if not self.attention.supports_graphs:
            return
        width = self.hidden.shape[1]
        rows = max(max_bs, verify_rows(verify_max_bs, tokens_per_request))
        self.fed = torch.zeros(rows, width, dtype=self.dtype, device=self.device)
        forward = HeadForward(self.head, self.embed, self.fed)
        target = GraphTarget(forward, self.attention, 2 * width, self.dtype, self.device, max_pages_per_request,
                             capture)
        self.decode_graphs = DecodeGraphRunner(target, max_bs)
        if self.attention.supports_verify_graphs:
            self.verify_graphs = VerifyGraphRunner(target, verify_max_bs, tokens_per_request, self.page_size)

    def _head_step(
        self, ids: torch.Tensor, fed: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a step's rows, fed `fed` [T, H]: (normed, pre-norm),
        by a graph's replay where one serves the step (views into its output:
        read them before the next replay), else eagerly."""
        replay = replaying(host_plan, self.decode_graphs, self.verify_graphs)
        if replay is None:
            return self.head(self.embed(ids), plan.positions, fed, self.attention.prepare(plan, host_plan))
        self.fed[: fed.shape[0]].copy_(fed)
        out = replay.run(ids, plan, host_plan)
        width = self.fed.shape[1]
        return out[:, :width], out[:, width:]

    @property
    def pool_bytes(self) -> int:
        tensors = (self.pool.buffer, self.next_token, self.hidden)
        return sum(t.numel() * t.element_size() for t in tensors)

    def propose(self, host_plan: BatchPlan, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's proposals [D] (DraftBatch order) and a copy of
        `input_ids` (the step's, on the device) with them in the placeholders' rows."""
        batch = host_plan.draft
        assert batch is not None
        ps = self.page_size
        offsets = batch.offsets
        starts = newest_positions(host_plan, batch)
        before = [int(host_plan.page_table[r, (p - 1) // ps]) * ps + (p - 1) % ps
                  for r, p in zip(batch.requests, starts)]
        state = upload(before, self.device)
        tokens, hidden = self.next_token[state], self.hidden[state]
        proposals = torch.zeros(batch.num_tokens, dtype=torch.long, device=self.device)
        proposals[upload(offsets, self.device)] = tokens
        for i in range(1, max(batch.lengths)):
            active = [j for j, length in enumerate(batch.lengths) if length > i]
            chosen = None if len(active) == len(batch.lengths) else upload(active, self.device)
            decode = decode_plan(host_plan, batch, active, starts, i - 1)  # at position p + i - 1
            fed_tokens = tokens if chosen is None else tokens[chosen]
            fed_hidden = hidden if chosen is None else hidden[chosen]
            normed, prenorm = self._head_step(fed_tokens, fed_hidden, decode.to(self.device), decode)
            drafted = self.head.propose(normed)
            proposals[upload([offsets[j] + i for j in active], self.device)] = drafted
            if chosen is None:
                tokens, hidden = drafted, prenorm
            else:
                tokens, hidden = tokens.index_copy(0, chosen, drafted), hidden.index_copy(0, chosen, prenorm)
        return proposals, with_proposals(batch, input_ids, proposals)

    def follow(self, plan: BatchPlan, host_plan: BatchPlan, aux: torch.Tensor, sampled: torch.Tensor) -> None:
        """The head over the whole step (`aux`: the target's three hidden
        states of every row; `sampled`: its tokens at plan.logits_indices)."""
        following = plan.following_ids
        if following is None:
            raise ValueError("an EAGLE-3 step's plan names no following tokens (BatchPlan.following_ids)")
        samples = plan.logits_indices if sampled.numel() else None
        if samples is not None:
            at_rows = torch.zeros_like(following)
            at_rows[samples] = sampled
            following = torch.where(following >= 0, following, at_rows)
        else:  # no row samples (prompt chunks only): every following token is the prompt's
            following = following.clamp(min=0)
        # fc here, so that the head is fed one width however it runs (the graphs' buffer).
        normed, prenorm = self._head_step(following, self.head.fc(aux), plan, host_plan)
        if samples is not None:
            slots = plan.out_cache_loc[samples]
            self.next_token[slots] = self.head.propose(normed[samples])
            self.hidden[slots] = prenorm[samples]
