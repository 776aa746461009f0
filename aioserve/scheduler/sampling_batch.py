"""Turn the sampling settings of a step's rows into SamplingTensors.

The random draw of each row is decided here, on the CPU: a seeded request
gets a draw that depends only on (seed, index of the token), so its tokens
do not change with the batch around it; unseeded rows draw from the
scheduler's own generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from aioserve.batch_plan import SamplingTensors
from aioserve.scheduler.constraint import bitmask_width
from aioserve.scheduler.request import Request

_MASK64 = (1 << 64) - 1


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
class SampleRow:
    request: Request
    token_index: int  # which output token this row samples (0 = the first)
    pending_placeholder: int | None  # placeholder id of the in-flight token, if any


class SamplingBatchBuilder:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], seed: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.rng = random.Random(seed)

    def build(self, rows: list[SampleRow]) -> SamplingTensors:
        temps, top_ks, top_ps, min_ps, uniforms = [], [], [], [], []
        presence, frequency, repetition = [], [], []
        bias_rows, bias_ids, bias_values = [], [], []
        out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
        num_top = 0
        grammar_rows = [i for i, row in enumerate(rows) if row.request.constraint is not None]
        bitmask = self._grammar_bitmask(rows, grammar_rows)
        for i, row in enumerate(rows):
            p = row.request.params
            greedy = p.greedy
            temps.append(0.0 if greedy else p.temperature)
            top_ks.append(p.top_k if p.top_k > 0 else self.vocab_size)
            top_ps.append(p.top_p)
            min_ps.append(0.0 if greedy else p.min_p)
            uniforms.append(seeded_uniform(p.seed, row.token_index) if p.seed is not None else self.rng.random())
            num_top = max(num_top, p.logprobs or 0)
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
                history = row.request.output_ids
                if row.pending_placeholder is not None:
                    history = history + [row.pending_placeholder]
                if p.presence_penalty or p.frequency_penalty:
                    out_rows += [i] * len(history)
                    out_ids += history
                if p.repetition_penalty != 1.0:
                    seen = set(row.request.prompt_ids) | set(history)
                    seen_rows += [i] * len(seen)
                    seen_ids += list(seen)
        sampled = [t > 0 for t in temps]
        return SamplingTensors(
            temperatures=torch.tensor(temps, dtype=torch.float32),
            top_ks=torch.tensor(top_ks, dtype=torch.long),
            top_ps=torch.tensor(top_ps, dtype=torch.float32),
            min_ps=torch.tensor(min_ps, dtype=torch.float32),
            uniforms=torch.tensor(uniforms, dtype=torch.float64),
            all_greedy=not any(sampled),
            needs_sort=any(s and (k < self.vocab_size or q < 1.0) for s, k, q in zip(sampled, top_ks, top_ps)),
            needs_min_p=any(s and m > 0 for s, m in zip(sampled, min_ps)),
            num_top_logprobs=num_top,
            bias_rows=torch.tensor(bias_rows, dtype=torch.long),
            bias_token_ids=torch.tensor(bias_ids, dtype=torch.long),
            bias_values=torch.tensor(bias_values, dtype=torch.float32),
            presence=torch.tensor(presence, dtype=torch.float32),
            frequency=torch.tensor(frequency, dtype=torch.float32),
            repetition=torch.tensor(repetition, dtype=torch.float32),
            output_rows=torch.tensor(out_rows, dtype=torch.long),
            output_token_ids=torch.tensor(out_ids, dtype=torch.long),
            seen_rows=torch.tensor(seen_rows, dtype=torch.long),
            seen_token_ids=torch.tensor(seen_ids, dtype=torch.long),
            grammar_rows=torch.tensor(grammar_rows, dtype=torch.long),
            grammar_bitmask=bitmask,
        )

    def _grammar_bitmask(self, rows: list[SampleRow], grammar_rows: list[int]) -> torch.Tensor:
        """The allowed tokens of each constrained row, from its matcher's
        current state: which is why such a row never follows a pending token."""
        bitmask = torch.zeros(len(grammar_rows), bitmask_width(self.vocab_size) if grammar_rows else 0, dtype=torch.int32)
        for k, i in enumerate(grammar_rows):
            row = rows[i]
            if row.pending_placeholder is not None:
                raise RuntimeError(f"request {row.request.rid} is constrained but planned after a pending token")
            assert row.request.constraint is not None
            row.request.constraint.fill_bitmask(bitmask, k)
        return bitmask
