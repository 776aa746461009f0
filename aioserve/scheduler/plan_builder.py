"""Collect a step's requests and turn them into a BatchPlan of plain tensors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from aioserve.batch_plan import (
    AdapterLoad, BatchPlan, DraftBatch, ImageBatch, LoraBatch, PoolingRequest, PromptLogprobRequest,
)
from aioserve.kvcache.page_table import PageTable
from aioserve.kvcache.request_kv import RequestKV
from aioserve.scheduler.encoder_cache import EncoderCacheTable
from aioserve.scheduler.request import Request
from aioserve.scheduler.sampling_batch import SampleRow, SamplingBatchBuilder


@dataclass
class StepEntry:
    """What the step does for one request, remembered until its output is processed."""

    request: Request
    kv: RequestKV  # the admission it was planned for: a step planned before a
    # preemption is stale for the readmitted request, which has a new handle
    kv_len_after: int
    first_position: int
    row: int | None = None  # sampled row, if this step samples the request
    prefill: bool = False  # a prompt chunk, not a decode
    prompt_logprob_span: tuple[int, int] | None = None  # (first, count) in the step's prompt logprobs
    draft: list[int] = field(default_factory=list)  # verified proposal: rows row .. row + len(draft) are sampled
    # A draft model's proposal: `draft` holds placeholders until the step's
    # output is processed; its tokens are StepOutput.draft_tokens[offset:offset + len(draft)].
    draft_offset: int | None = None
    pool_segment: int | None = None  # a pooling request's chunk: its index in the step's pooling segments


@dataclass
class ScheduledStep:
    plan: BatchPlan
    entries: list[StepEntry]
    num_prefill_tokens: int


@dataclass
class PlanBuilder:
    step: int
    page_size: int
    table: PageTable
    sampling: SamplingBatchBuilder
    ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    entries: list[StepEntry] = field(default_factory=list)
    sample_rows: list[SampleRow] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    prompt_lp_indices: list[int] = field(default_factory=list)
    prompt_lp_targets: list[int] = field(default_factory=list)
    prompt_lp_top: int = 0
    num_decodes: int = 0
    pool_starts: list[int] = field(default_factory=list)
    pool_lengths: list[int] = field(default_factory=list)
    pool_type: str = ""  # one pooling model a server: every segment pools alike
    pool_score: bool = False
    lora_slots: list[int] = field(default_factory=list)  # each entry's LoRA slot (0: the base model)
    images: EncoderCacheTable | None = None  # a vision-language model's image rows go through it
    # An M-RoPE request's entry, where its positions are not start.. : its
    # generated tokens' shift (their KV index plus the delta, every axis
    # alike: a decode plans no tensor), or its prompt chunk's own positions
    # ([N] where the three axes agree, else [3, N]).
    position_shifts: dict[int, int] = field(default_factory=dict)
    explicit_positions: dict[int, torch.Tensor] = field(default_factory=dict)
    # Verifications whose proposals the engine's draft model makes.
    draft_batch: DraftBatch = field(default_factory=lambda: DraftBatch([], [], []))
    # An EAGLE-3 head follows the target: each row's next token where the host
    # knows it, else -1 (BatchPlan.following_ids). Off: nothing is collected.
    track_following: bool = False
    following: list[int] = field(default_factory=list)

    def add(
        self,
        request: Request,
        token_ids: list[int],
        start: int,
        sample: SampleRow | None,
        decode: bool,
        prompt_lp_targets: list[int] | None = None,
    ) -> StepEntry:
        """Add `token_ids` at positions start.. of `request`. Decodes (one
        token after the request's whole KV) come before any extend."""
        kv = request.admitted_kv
        if decode:
            if len(self.lengths) != self.num_decodes or len(token_ids) != 1:
                raise ValueError("decodes are single tokens added before every extend")
            self.num_decodes += 1
        first_row = len(self.ids)
        self.ids += token_ids
        if self.track_following:
            # Within a prompt chunk the next row's token; after its last row
            # the prompt's next one, unless the step samples it (-1).
            known = request.all_ids
            end = start + len(token_ids)
            self.following += token_ids[1:] if not decode else []
            self.following.append(known[end] if not decode and end < len(known) else -1)
        self.starts.append(start)
        self.lengths.append(len(token_ids))
        self.slots.append(kv.slot)
        self.lora_slots.append(request.lora_slot)
        images = request.images
        if images is not None:
            end = start + len(token_ids)
            if images.mrope is not None and start >= images.mrope.shape[1]:
                self.position_shifts[len(self.entries)] = images.rope_delta
            elif images.mrope is not None:
                self.explicit_positions[len(self.entries)] = _mrope_positions(images.positions(start, end))
            spans = images.spans_in(start, end) if not decode else []
            if spans and self.images is not None:
                self.images.add_chunk(request.rid, spans, start, end, first_row)
        entry = StepEntry(request, kv, start + len(token_ids), start, prefill=not decode)
        if sample is not None:
            entry.row = len(self.sample_rows)
            self.sample_rows.append(sample)
            self.logits_indices.append(len(self.ids) - 1)
        if request.pooling is not None:
            entry.pool_segment = len(self.pool_starts)
            self.pool_starts.append(first_row)
            self.pool_lengths.append(len(token_ids))
            self.pool_type, self.pool_score = request.pooling.pooling_type, request.pooling.score
        if prompt_lp_targets:
            entry.prompt_logprob_span = (len(self.prompt_lp_indices), len(prompt_lp_targets))
            self.prompt_lp_indices += range(first_row, first_row + len(prompt_lp_targets))
            self.prompt_lp_targets += prompt_lp_targets
            self.prompt_lp_top = max(self.prompt_lp_top, request.params.prompt_logprobs or 0)
        self.entries.append(entry)
        return entry

    def add_verify(
        self, request: Request, draft: list[int], samples: list[SampleRow], in_engine: bool = False
    ) -> StepEntry:
        """A decoding request's newest token and a proposal after it, as an
        extend that samples every position (the first row is `entry.row`).
        `in_engine`: `draft` is placeholders for the engine's draft model to fill."""
        start = request.kv_len
        entry = self.add(request, [request.all_ids[-1], *draft], start, None, decode=False)
        entry.prefill, entry.draft, entry.row = False, draft, len(self.sample_rows)
        first_row = len(self.ids) - len(samples)
        if self.track_following:  # every verified row's next token is the target's sample there
            self.following[first_row:] = [-1] * len(samples)
        self.sample_rows += samples
        self.logits_indices += range(first_row, len(self.ids))
        if in_engine:
            entry.draft_offset = self.draft_batch.add(len(self.entries) - 1, first_row, len(draft))
        return entry

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def _has_mrope_rows(self) -> bool:
        return any(p.dim() == 2 for p in self.explicit_positions.values())

    def _mrope_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[3, T] positions: each entry's three rows (its image tokens'
        differ), or its one row thrice."""
        rows = flat.expand(3, -1).clone()
        first = 0
        for i, length in enumerate(self.lengths):
            explicit = self.explicit_positions.get(i)
            if explicit is not None and explicit.dim() == 2:
                rows[:, first:first + length] = explicit
            first += length
        return rows

    def build(self, lora_loads: list[AdapterLoad] | None = None, images: ImageBatch | None = None) -> ScheduledStep:
        """The plan; `lora_loads` (with LoRA served, even if empty) gives it each
        request's adapter slot and the loads to do first; `images` the
        image work its rows need (the encoder cache table's take())."""
        # Plain list arithmetic, then one tensor per field: a decode step's
        # plan is a few dozen numbers, and as tensor ops (repeat_interleave,
        # cumsum, gathers: ~15 of them) it cost the event loop ~0.1-0.5 ms a
        # step, a tenth of a small model's step on a CPU.
        ps = self.page_size
        seq_lens = [start + length for start, length in zip(self.starts, self.lengths)]
        width = -(-max(seq_lens) // ps)
        # Per token: its position, and its KV slot in the request's pages
        # (the page table's row for it: the KV manager writes both alike).
        positions: list[int] = []
        out_cache_loc: list[int] = []
        plain_positions = not self.explicit_positions and not self.position_shifts
        for i, (entry, start, end) in enumerate(zip(self.entries, self.starts, seq_lens)):
            if end - start == 1 and plain_positions:  # a decode (most rows of most steps): one slot
                positions.append(start)
                out_cache_loc.append(entry.kv.page(start // ps) * ps + start % ps)
                continue
            pages = entry.kv.pages
            explicit = self.explicit_positions.get(i)
            if explicit is None:
                shift = self.position_shifts.get(i, 0)
                positions += range(start + shift, end + shift)
            else:  # an M-RoPE request's own (three rows: the first here, all three in _mrope_rows)
                positions += (explicit if explicit.dim() == 1 else explicit[0]).tolist()
            for index in range(start // ps, (end - 1) // ps + 1):
                base = pages[index] * ps
                out_cache_loc += range(base + max(start - index * ps, 0), base + min(end - index * ps, ps))
        prompt_lp = None
        if self.prompt_lp_indices:
            prompt_lp = PromptLogprobRequest(
                token_indices=torch.tensor(self.prompt_lp_indices, dtype=torch.long),
                target_ids=torch.tensor(self.prompt_lp_targets, dtype=torch.long),
                num_top=self.prompt_lp_top,
            )
        # The int64 fields as views of one tensor: one conversion, not six
        # (each a call into torch that the forward's thread may take the GIL
        # back in; see sampling_batch.py).
        fields = (self.ids, positions, out_cache_loc, seq_lens, self.lengths, self.logits_indices, self.slots,
                  self.following)
        flat = torch.tensor(list(itertools.chain.from_iterable(fields)), dtype=torch.long)
        input_ids, positions_t, slots_t, seq_lens_t, extend_lens, logits_indices, table_slots, following = flat.split(
            [len(f) for f in fields]
        )
        plan = BatchPlan(
            step=self.step,
            input_ids=input_ids,
            positions=self._mrope_rows(positions_t) if self._has_mrope_rows else positions_t,
            out_cache_loc=slots_t,
            seq_lens=seq_lens_t,
            extend_lens=extend_lens,
            page_table=self.table.rows(table_slots, width),
            num_decodes=self.num_decodes,
            logits_indices=logits_indices,
            sampling=self.sampling.build(self.sample_rows) if self.sample_rows else None,
            prompt_logprobs=prompt_lp,
            pooling=PoolingRequest(
                torch.tensor(self.pool_starts, dtype=torch.long), torch.tensor(self.pool_lengths, dtype=torch.long),
                self.pool_type, self.pool_score,
            ) if self.pool_starts else None,
            lora=LoraBatch(torch.tensor(self.lora_slots, dtype=torch.long), lora_loads)
            if lora_loads is not None else None,
            images=images,
            draft=self.draft_batch if self.draft_batch.requests else None,
            following_ids=following if self.track_following else None,
        )
        num_prefill = sum(length for entry, length in zip(self.entries, self.lengths) if entry.prefill)
        return ScheduledStep(plan, self.entries, num_prefill)


def _mrope_positions(block: torch.Tensor) -> torch.Tensor:
    """An M-RoPE request's [3, N] positions as one row [N] where its three
    axes agree (text, and every generated token: M-RoPE is then plain RoPE,
    and the step keeps its fast paths), else as they are."""
    return block[0] if bool((block[0] == block[1]).all() and (block[0] == block[2]).all()) else block
