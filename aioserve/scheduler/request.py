"""A request's life in the scheduler, and the events it sends its consumer.

Bookkeeping, with overlap in mind:
* `all_ids`: prompt + the output tokens processed so far.
* `kv`: its KV handle while admitted (owned by the KVManager): slot, pages,
  `kv_len` (tokens whose KV is computed or scheduled) and `kv_done`
  (computed by steps already processed).
* `pending`: sampled tokens scheduled but not processed yet (0, 1 or 2;
  at most 1 for a grammar-constrained request, whose mask needs its tokens).
A request is *prefilling* while more than its newest token lacks KV, and
*decoding* when only the newest token (known, or pending) does.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aioserve.image_inputs import PromptImages
from aioserve.kvcache.request_kv import RequestKV
from aioserve.sampling_params import SamplingParams
from aioserve.scheduler.adapters import Adapter
from aioserve.scheduler.constraint import ConstraintFactory, TokenConstraint
from aioserve.scheduler.pending_tokens import PendingTokens
from aioserve.scheduler.pooling import PooledOutput, PoolingState


class RequestRejected(ValueError):
    """A request the scheduler can never serve (too long for the context or the pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpeculativeCounts:
    """One request's speculative decoding so far (SGLang's meta_info names
    them spec_verify_ct, spec_num_proposed_drafts, spec_num_correct_drafts)."""

    steps: int = 0  # steps that gave it tokens (a verification or a plain one)
    proposed: int = 0  # tokens proposed for it and verified
    accepted: int = 0  # of those, the ones that stood


@dataclass
class RequestEvent:
    """One step's news for a request's consumer."""

    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    # Sent with the first event only.
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    prompt_logprob_ranks: list[int] | None = None  # of each prompt token after the first
    error: str | None = None
    speculation: SpeculativeCounts | None = None  # with speculative decoding on: the counts so far
    pooled: PooledOutput | None = None  # a pooling request's last event: its vector (and scores)


EventSink = Callable[[RequestEvent], None]


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: EventSink
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # first admission (time.monotonic), for the queue-time metric
    max_new_tokens: int = 0  # set by the scheduler from max_tokens and the context
    status: Status = Status.WAITING
    all_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    kv: RequestKV | None = None  # while admitted (see the module docstring)
    pending: PendingTokens = field(default_factory=PendingTokens)
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)
    prompt_logprob_ranks: list[int] = field(default_factory=list)  # beside prompt_logprobs[1:]
    first_event_sent: bool = False
    finish_reason: str | None = None
    speculation: SpeculativeCounts | None = None  # set at submission when speculative decoding is on
    grammar: ConstraintFactory | None = None  # compiled from params.structured_outputs
    constraint: TokenConstraint | None = None  # its matcher, made at submission
    pooling: PoolingState | None = None  # an embedding or score request: computes its prompt, generates nothing
    adapter: Adapter | None = None  # the LoRA adapter it runs under (None: the base model)
    lora_slot: int = 0  # while running under an adapter: the slot holding it (scheduler/adapters.py)
    images: PromptImages | None = None  # a vision-language model's prompt images (image_inputs.py)

    def __post_init__(self) -> None:
        if not self.all_ids:
            self.all_ids = list(self.prompt_ids)

    @property
    def cache_ids(self) -> list[int]:
        """Its tokens as the prefix cache keys them: `all_ids`, with each
        image's placeholders standing for that image's content."""
        if self.images is None:
            return self.all_ids
        return self.images.cache_ids(self.prompt_ids) + self.all_ids[len(self.prompt_ids):]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[len(self.prompt_ids) :]

    @property
    def num_generated(self) -> int:
        """Output tokens including those still in flight."""
        return len(self.all_ids) - len(self.prompt_ids) + self.pending.count

    @property
    def seq_len(self) -> int:
        """Tokens including those still in flight."""
        return len(self.all_ids) + self.pending.count

    @property
    def admitted_kv(self) -> RequestKV:
        """The KV handle of a running request."""
        if self.kv is None:
            raise RuntimeError(f"request {self.rid} is not admitted")
        return self.kv

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is computed or scheduled (0 while not admitted)."""
        return self.kv.kv_len if self.kv is not None else 0

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token lacks KV. (With only the newest
        missing, the request decodes, whether that token is known or pending.)
        A request that generates nothing (max_tokens 0: prompt logprobs, a
        pooling request) computes its prompt's last token as prompt too: were
        a chunk to leave only that one, no decode would ever compute it."""
        # kv_len and seq_len spelled out: three calls a running request a step.
        kv_len = self.kv.kv_len if self.kv is not None else 0
        seq_len = len(self.all_ids) + self.pending.count
        if self.max_new_tokens == 0 and self.status is Status.RUNNING:
            return kv_len < seq_len
        return kv_len < seq_len - 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def is_constrained(self) -> bool:
        return self.constraint is not None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
