"""Turn the sampling settings of a step's rows into SamplingTensors.

The random draw of each row is decided here, on the CPU: a seeded request
gets a draw that depends only on (seed, index of the token), so its tokens
do not change with the batch around it; unseeded rows draw from the
scheduler's own generator.

Penalties need each request's history (output tokens with repeats for
presence/frequency, prompt and output tokens once each for repetition).
Rebuilding those lists every step cost O(prompt + output) Python work per
penalised request per step on the loop's thread; `_PenaltyHistory` instead
folds in only the tokens accepted since the last step, into `array`s the
step's tensors are concatenated from at C speed.
"""

from __future__ import annotations

import random
import weakref
from array import array
from dataclasses import dataclass, field

import torch

from aioserve.batch_plan import SamplingTensors
from aioserve.scheduler.constraint import bitmask_width
from aioserve.scheduler.request import Request

_MASK64 = (1 << 64) - 1

# Shared empty fields: most steps have no bias, penalty or grammar rows, and
# each torch.tensor([]) is a call into torch on the event loop's thread
# (where the forward's thread may take the GIL meanwhile). Never written to.
_NO_LONGS = torch.zeros(0, dtype=torch.long)
_NO_FLOATS = torch.zeros(0, dtype=torch.float32)
_NO_BITMASK = torch.zeros(0, 0, dtype=torch.int32)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, index): 53 random bits of a
    two-round splitmix64 hash."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 11) / float(1 << 53)


@dataclass
class _PenaltyHistory:
    """One request's penalty history, brought up to date incrementally."""

    output: array = field(default_factory=lambda: array("q"))  # every output token, in order
    seen: array = field(default_factory=lambda: array("q"))  # prompt and output tokens, once each
    seen_set: set[int] = field(default_factory=set)
    num_synced: int = 0  # output tokens folded in so far

    @classmethod
    def of_prompt(cls, prompt_ids: list[int]) -> "_PenaltyHistory":
        history = cls()
        history.seen_set = set(prompt_ids)
        history.seen = array("q", history.seen_set)
        return history

    def sync(self, request: Request) -> None:
        """Fold in the output tokens accepted since the last call (usually one)."""
        start = request.num_prompt_tokens + self.num_synced
        new = request.all_ids[start:]
        self.output.extend(new)
        for token in new:
            if token not in self.seen_set:
                self.seen_set.add(token)
                self.seen.append(token)
        self.num_synced += len(new)


class _PenaltyLists:
    """The (row, token) lists of one step's penalised rows, as flat arrays."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.lengths: list[int] = []
        self.ids = array("q")

    def add(self, row: int, tokens: array, pending: int | None, drafted: tuple[int, ...] = ()) -> None:
        self.ids.extend(tokens)  # array from array: a memcpy
        if pending is not None:
            self.ids.append(pending)
        self.ids.extend(drafted)
        self.rows.append(row)
        self.lengths.append(len(tokens) + (pending is not None) + len(drafted))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.ids:
            return _NO_LONGS, _NO_LONGS
        rows = torch.repeat_interleave(torch.tensor(self.rows, dtype=torch.long), torch.tensor(self.lengths))
        # frombuffer shares the array's memory (kept alive by the tensor); the
        # array is this step's own and never changes again.
        return rows, torch.frombuffer(self.ids, dtype=torch.long)


@dataclass
class SampleRow:
    request: Request
    token_index: int  # which output token this row samples (0 = the first)
    pending_placeholder: int | None  # placeholder id of the in-flight token, if any
    drafted: tuple[int, ...] = ()  # proposed tokens before this row's position (a verified draft's rows)


class SamplingBatchBuilder:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], seed: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.rng = random.Random(seed)
        # Weak keys: a finished request's history goes when the request does.
        self._histories: weakref.WeakKeyDictionary[Request, _PenaltyHistory] = weakref.WeakKeyDictionary()

    def _history(self, request: Request) -> _PenaltyHistory:
        history = self._histories.get(request)
        if history is None or history.num_synced > request.num_output_tokens:
            history = self._histories[request] = _PenaltyHistory.of_prompt(request.prompt_ids)
        history.sync(request)
        return history

    def build(self, rows: list[SampleRow]) -> SamplingTensors:
        temps, top_ks, top_ps, min_ps, uniforms = [], [], [], [], []
        presence, frequency, repetition = [], [], []
        bias_rows, bias_ids, bias_values = [], [], []
        outputs, seen = _PenaltyLists(), _PenaltyLists()
        num_top = 0
        wants_logprobs = False
        grammar_rows = [i for i, row in enumerate(rows) if row.request.constraint is not None]
        bitmask = self._grammar_bitmask(rows, grammar_rows)
        for i, row in enumerate(rows):
            p = row.request.params
            greedy = p.greedy
            temps.append(0.0 if greedy else p.temperature)
            top_ks.append(min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size)
            top_ps.append(p.top_p)
            min_ps.append(0.0 if greedy else p.min_p)
            uniforms.append(seeded_uniform(p.seed, row.token_index) if p.seed is not None else self.rng.random())
            num_top = max(num_top, p.logprobs or 0)
            wants_logprobs |= p.logprobs is not None
            for token, value in p.logit_bias.items():
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(value)
            if row.token_index < p.min_tokens and row.request.constraint is None:
                # Too early to stop (a grammar decides that itself): EOS and the stop tokens cannot be chosen.
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                bias_rows += [i] * len(banned)
                bias_ids += sorted(banned)
                bias_values += [float("-inf")] * len(banned)
            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            repetition.append(p.repetition_penalty)
            if p.has_penalties:
                # The token in flight (a placeholder) belongs to the history
                # too, as do the proposed tokens before a verified row; listed
                # in `seen` they may repeat a token, which is harmless.
                history = self._history(row.request)
                if p.presence_penalty or p.frequency_penalty:
                    outputs.add(i, history.output, row.pending_placeholder, row.drafted)
                if p.repetition_penalty != 1.0:
                    seen.add(i, history.seen, row.pending_placeholder, row.drafted)
        sampled = [t > 0 for t in temps]
        out_rows, out_ids = outputs.tensors()
        seen_rows, seen_ids = seen.tensors()
        # The per-row float32 fields as rows of one tensor (one conversion).
        temperatures, top_ps_t, min_ps_t, presence_t, frequency_t, repetition_t = torch.tensor(
            [temps, top_ps, min_ps, presence, frequency, repetition], dtype=torch.float32
        ).unbind(0)
        return SamplingTensors(
            temperatures=temperatures,
            top_ks=torch.tensor(top_ks, dtype=torch.long),
            top_ps=top_ps_t,
            min_ps=min_ps_t,
            uniforms=torch.tensor(uniforms, dtype=torch.float64),
            all_greedy=not any(sampled),
            needs_sort=any(s and (k < self.vocab_size or q < 1.0) for s, k, q in zip(sampled, top_ks, top_ps)),
            needs_min_p=any(s and m > 0 for s, m in zip(sampled, min_ps)),
            num_top_logprobs=num_top,
            wants_logprobs=wants_logprobs,
            bias_rows=torch.tensor(bias_rows, dtype=torch.long) if bias_rows else _NO_LONGS,
            bias_token_ids=torch.tensor(bias_ids, dtype=torch.long) if bias_rows else _NO_LONGS,
            bias_values=torch.tensor(bias_values, dtype=torch.float32) if bias_rows else _NO_FLOATS,
            presence=presence_t,
            frequency=frequency_t,
            repetition=repetition_t,
            output_rows=out_rows,
            output_token_ids=out_ids,
            seen_rows=seen_rows,
            seen_token_ids=seen_ids,
            grammar_rows=torch.tensor(grammar_rows, dtype=torch.long) if grammar_rows else _NO_LONGS,
            grammar_bitmask=bitmask,
        )

    def _grammar_bitmask(self, rows: list[SampleRow], grammar_rows: list[int]) -> torch.Tensor:
        """The allowed tokens of each constrained row, from its matcher's
        current state (which is why such a row never follows a pending
        token), advanced by the proposed tokens before the row's position
        for a verified draft's rows, and rolled back after."""
        if not grammar_rows:
            return _NO_BITMASK
        bitmask = torch.zeros(len(grammar_rows), bitmask_width(self.vocab_size), dtype=torch.int32)
        for k, i in enumerate(grammar_rows):
            row = rows[i]
            if row.pending_placeholder is not None:
                raise RuntimeError(f"request {row.request.rid} is constrained but planned after a pending token")
            constraint = row.request.constraint
            assert constraint is not None
            for token in row.drafted:
                if not constraint.accept(token):
                    raise RuntimeError(f"request {row.request.rid}: its grammar refused a proposal it had allowed")
            constraint.fill_bitmask(bitmask, k)
            constraint.rollback(len(row.drafted))
        return bitmask
