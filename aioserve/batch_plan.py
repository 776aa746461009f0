"""The batch plan: everything one forward step needs, as plain tensors.

The scheduler builds a plan; the engine executes it without touching any
scheduler object. That split is what lets a tensor-parallel follower run the
same step from a plan broadcast by rank 0. Imports nothing of the project.

Token ids in a plan may be *placeholders*: a negative id `-(row + 1)` stands
for the token sampled at `row` of the step executed just before this one. With
overlap scheduling the scheduler builds step N+1 before step N's tokens are
known; the engine, which runs steps in order, fills them in.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Plain = TypeVar("_Plain", bound="DataclassInstance")


def _move(obj: _Plain, device: torch.device, **nested: object) -> _Plain:
    """A copy of a dataclass with every tensor moved to `device` (and the
    `nested` fields, already moved, in place of its own), without
    waiting: an upload goes through pinned memory (torch's caching host
    allocator keeps the blocks, so that is a small memcpy, not a cudaHostAlloc),
    because a copy from pageable memory may wait for the stream, i.e. for the
    step still running; a download lands in pinned memory by itself."""
    moved: dict[str, object] = {}
    upload = device.type == "cuda"
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            if upload and value.device.type == "cpu" and value.numel():
                value = value.pin_memory()
            value = value.to(device, non_blocking=True)
            moved[f.name] = value
    return replace(obj, **moved, **nested)


# Extends up to this many tokens after a prefix (a verified draft of
# speculative decoding) can run as decodes, a token at a time: each is a
# decode at its own KV length over its request's pages (the step stores
# every new token's KV before any is read). On CPU the native decode kernels
# then serve them (a 5-token verification of the demo model: SDPA's flash
# kernel took 0.5 ms a layer, most of the step).
MAX_EXTEND_AS_DECODES = 16


def extend_runs_as_decodes(new_tokens: int, kv_len: int) -> bool:
    """Whether an extend of `new_tokens` ending at `kv_len` is short and after a prefix."""
    return new_tokens <= MAX_EXTEND_AS_DECODES and kv_len > new_tokens


def token_rows(seq_lens: list[int], extend_lens: list[int]) -> tuple[list[int], list[int]]:
    """Each new token of the step as a decode of its own: the request it
    belongs to and its KV length, up to and including it."""
    requests: list[int] = []
    lengths: list[int] = []
    for i, (total, new) in enumerate(zip(seq_lens, extend_lens)):
        requests += [i] * new
        lengths += range(total - new + 1, total + 1)
    return requests, lengths


@dataclass
class SamplingTensors:
    """Per sampled row settings; S rows, one per request that samples this step."""

    temperatures: torch.Tensor  # [S] float32; 0 = greedy
    top_ks: torch.Tensor  # [S] int64; vocab size = off
    top_ps: torch.Tensor  # [S] float32
    min_ps: torch.Tensor  # [S] float32
    uniforms: torch.Tensor  # [S] float64 in [0, 1): the random draw of each row
    all_greedy: bool
    needs_sort: bool  # some row uses top_k or top_p
    needs_min_p: bool  # some row uses min_p (a plain flag: no device sync to find out)
    num_top_logprobs: int  # top-N logprobs to return per row (0 = none)
    wants_logprobs: bool  # some row reports its chosen token's logprob (always, with top-N); else none is computed
    # Additive logit changes: logit_bias, and -inf for EOS under min_tokens.
    bias_rows: torch.Tensor  # [K] int64
    bias_token_ids: torch.Tensor  # [K] int64
    bias_values: torch.Tensor  # [K] float32
    # Penalties. Output tokens are listed once per occurrence (frequency
    # counts); `seen` lists prompt + output tokens for repetition_penalty.
    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    repetition: torch.Tensor  # [S] float32
    output_rows: torch.Tensor  # [M] int64
    output_token_ids: torch.Tensor  # [M] int64, may hold placeholders
    seen_rows: torch.Tensor  # [R] int64
    seen_token_ids: torch.Tensor  # [R] int64, may hold placeholders
    # Constrained decoding: the rows whose next token must follow a grammar and,
    # per such row, the allowed tokens as a packed bitmask (bit t % 32 of word
    # t // 32 set = token t allowed). Rows here never sample after a pending
    # token: the mask is computed from the grammar state when the plan is built.
    grammar_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [G] int64
    grammar_bitmask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int32))  # [G, W] int32

    @property
    def has_penalties(self) -> bool:
        return self.output_rows.numel() > 0 or self.seen_rows.numel() > 0

    @property
    def takes_raw_argmax(self) -> bool:
        """Every row's token is the argmax of the model's own logits: all
        greedy, no bias, penalty or grammar, and no logprobs wanted (top-N
        implies them). The sampler's fast path and the greedy screen."""
        return (
            self.all_greedy
            and not self.wants_logprobs
            and not self.has_penalties
            and self.bias_rows.numel() == 0
            and self.grammar_rows.numel() == 0
        )

    def to(self, device: torch.device) -> "SamplingTensors":
        return _move(self, device)


@dataclass
class PromptLogprobRequest:
    """Rows of the step whose *next prompt token* gets a logprob (echo + logprobs)."""

    token_indices: torch.Tensor  # [P] int64 rows of the flat token batch
    target_ids: torch.Tensor  # [P] int64 the prompt token that follows each row
    num_top: int

    def to(self, device: torch.device) -> "PromptLogprobRequest":
        return _move(self, device)


@dataclass
class PoolingRequest:
    """Segments of the step's rows whose final hidden states a pooling
    request needs: one per request chunk (a pooling model serves nothing else)."""

    starts: torch.Tensor  # [P] int64: the segment's first row of the flat token batch
    lengths: torch.Tensor  # [P] int64: its rows
    pooling_type: str  # LAST (the last row) | MEAN (the rows' sum: the host divides) | CLS (the first row)
    score: bool  # also the model's score head, on the row its `score_row` names

    def to(self, device: torch.device) -> "PoolingRequest":
        return _move(self, device)


@dataclass
class AdapterLoad:
    """Copy adapter `adapter_id` (its PEFT folder: `path`) into LoRA slot
    `slot` before the step runs: the slot's earlier adapter is no longer used."""

    slot: int
    adapter_id: int
    path: str


@dataclass
class LoraBatch:
    """Which LoRA adapter each request of the step uses, and the slot loads
    the step needs first (every rank does the same loads)."""

    request_slots: torch.Tensor  # [B] int64: each request's adapter slot; 0 = the base model
    loads: list[AdapterLoad] = field(default_factory=list)

    @property
    def uses_adapters(self) -> bool:
        """Some request of the step runs under an adapter (read on the host plan)."""
        return any(self.request_slots.tolist())


@dataclass
class ImageToEncode:
    """An image the step's vision encoder runs on first: its processor's
    tensors by name (image_inputs.ProcessedImage), kept under `key`."""

    key: int
    names: list[str]
    tensors: list[torch.Tensor]


@dataclass
class ImageRows:
    """Rows [row, row + length) of the step's tokens take rows [first,
    first + length) of image `key`'s embeddings instead of their tokens'."""

    row: int
    key: int
    first: int
    length: int
    # Gemma 3: the image's tokens attend to each other both ways. The plan's
    # chunk then holds all of the image it has not computed before, so these
    # rows see every key up to the last of them (attention backends' masks).
    bidirectional: bool = False


@dataclass
class ImageBatch:
    """A vision-language model's step with image tokens. The engine keeps
    each image's embeddings by key from the step that encodes it until a
    plan evicts it (the scheduler tracks the same set: scheduler/encoder_cache.py),
    so an image whose tokens span several chunks, or several requests, is
    encoded once."""

    evict: list[int]  # keys dropped first: no request needs them any more
    encode: list[ImageToEncode]  # then encoded, in one pass of the encoder
    rows: list[ImageRows]  # in row order

    def both_ways(self) -> list[tuple[int, int]]:
        """[first, end) row ranges whose tokens attend to each other both ways."""
        return [(r.row, r.row + r.length) for r in self.rows if r.bidirectional]

    def row_indices(self) -> torch.Tensor:
        """[M] int64: every row that takes an image embedding, in order."""
        if not self.rows:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(r.row, r.row + r.length) for r in self.rows])


@dataclass
class DraftBatch:
    """Verifications whose proposals a draft model makes inside the step
    (speculative decoding's draft_model method). Entry j is the plan's
    request `requests[j]`, an extend whose row `first_rows[j]` holds its
    newest token and whose next `lengths[j]` rows are placeholders (0) for
    the proposals: the engine decodes them with the draft and writes them
    there before the target's forward verifies them. Plain host lists: the
    engine plans the draft's decodes from them without a device sync."""

    requests: list[int]
    first_rows: list[int]
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        """Proposals in all; StepOutput.draft_tokens lists them entry by entry."""
        return sum(self.lengths)

    @property
    def offsets(self) -> list[int]:
        """Where each entry's proposals start in StepOutput.draft_tokens."""
        return [sum(self.lengths[:j]) for j in range(len(self.lengths))]

    def add(self, request: int, first_row: int, length: int) -> int:
        """One more verification; returns where its proposals start in StepOutput.draft_tokens."""
        offset = self.num_tokens
        self.requests.append(request)
        self.first_rows.append(first_row)
        self.lengths.append(length)
        return offset


@dataclass
class BatchPlan:
    """One forward step over B requests and T new tokens.

    Requests are ordered decodes first (one token each), then extends
    (prefill chunks, possibly on top of a cached prefix).
    """

    step: int
    input_ids: torch.Tensor  # [T] int64, may hold placeholders
    # [T] int64; [3, T] (time, height, width) in an M-RoPE model's steps with image tokens
    positions: torch.Tensor
    out_cache_loc: torch.Tensor  # [T] int64: KV slot (page * page_size + offset) of each new token
    seq_lens: torch.Tensor  # [B] int64: KV length of each request after this step
    extend_lens: torch.Tensor  # [B] int64: new tokens of each request
    page_table: torch.Tensor  # [B, P] int32: the pages of each request, padded with 0
    num_decodes: int  # the first num_decodes requests have extend_len 1 and come first
    logits_indices: torch.Tensor  # [S] int64: rows of T whose next token is sampled
    sampling: SamplingTensors | None  # None when no row samples (mid-prompt chunks only)
    prompt_logprobs: PromptLogprobRequest | None = None
    pooling: PoolingRequest | None = None
    lora: LoraBatch | None = None  # with LoRA adapters served: each request's slot, the loads first
    images: ImageBatch | None = None  # steps with image tokens (a vision-language model)
    draft: DraftBatch | None = None  # verifications whose proposals the engine's draft model makes
    # [T] int64, an EAGLE-3 head's steps only: the token after each row where
    # the host knows it (the prompt's next), else -1 (the target samples it
    # this step: engine/eagle3_runner.py).
    following_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def has_image_rows(self) -> bool:
        """Some row takes an image's embedding (or needs M-RoPE's three
        positions): only the model's own forward computes those, never a
        captured decode."""
        return (self.images is not None and bool(self.images.rows)) or self.positions.dim() == 2

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_requests

    def runs_as_decodes(self) -> bool:
        """Every extend is short and after a prefix (MAX_EXTEND_AS_DECODES):
        the whole step can run as decodes, a token each (read on the host plan)."""
        lengths = self.extend_lens[self.num_decodes :].tolist()
        totals = self.seq_lens[self.num_decodes :].tolist()
        return all(extend_runs_as_decodes(new, total) for new, total in zip(lengths, totals))

    def to(self, device: torch.device) -> "BatchPlan":
        if device.type == "cpu" and self.input_ids.device.type == "cpu":
            # Already there: new plan objects over the same tensors, which is
            # what moving gives, in 6 us instead of 34 (a decode step's
            # critical path on a CPU).
            plan = copy.copy(self)
            if self.sampling is not None:
                plan.sampling = copy.copy(self.sampling)
            if self.prompt_logprobs is not None:
                plan.prompt_logprobs = copy.copy(self.prompt_logprobs)
            if self.pooling is not None:
                plan.pooling = copy.copy(self.pooling)
            return plan
        # `lora` stays on the host (_move moves tensor fields only): the engine routes rows from it.
        return _move(
            self, device,
            sampling=self.sampling.to(device) if self.sampling is not None else None,
            prompt_logprobs=self.prompt_logprobs.to(device) if self.prompt_logprobs is not None else None,
            pooling=self.pooling.to(device) if self.pooling is not None else None,
        )


@dataclass
class StepOutput:
    """What one step returns, on the CPU."""

    next_token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32: logprob of each chosen token
    top_ids: torch.Tensor | None  # [S, N] int64
    top_logprobs: torch.Tensor | None  # [S, N] float32
    prompt_logprobs: torch.Tensor | None = None  # [P] float32
    prompt_top_ids: torch.Tensor | None = None  # [P, N]
    prompt_top_logprobs: torch.Tensor | None = None  # [P, N]
    prompt_ranks: torch.Tensor | None = None  # [P] int64: each prompt token's rank (1: the likeliest)
    pooled: torch.Tensor | None = None  # [P, H] float32: each pooling segment's row (LAST, CLS) or sum (MEAN)
    scores: torch.Tensor | None = None  # [P, L] float32: the score head's logits of each segment
    draft_tokens: torch.Tensor | None = None  # [D] int64: the draft model's proposals, in DraftBatch order

    def to(self, device: torch.device) -> "StepOutput":
        """Copies issued without waiting (D2H lands in pinned memory); the
        caller synchronizes before reading, e.g. on a CUDA event."""
        return _move(self, device)
