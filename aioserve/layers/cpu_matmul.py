"""How each weight is multiplied on the CPU, chosen by timing at load.

A decode step multiplies thin activations (1 to a few dozen rows) by tall
weights, and which BLAS call is fast for that varies by machine, shape and
row count more than any rule captures: on one AVX-512 box the tiny-llama LM
head ([32000, 288], one row) took 4.8 ms as x @ W^T from row-major W and
1.5 ms from the same weight stored column-major, while with four rows the
row-major (W x^T)^T was 3.5x faster than either. So, once per weight shape,
`tune_cpu_matmuls` times both storage orders and both call forms at a few row
counts, keeps the storage order that wins overall (the weight is stored once,
in that order; its logical shape stays [out, in], so everything else that
reads it, a tied embedding included, is unchanged) and, per row count, the
faster form. Larger batches (prefill) use the untuned form.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 16, 64)  # row counts timed; a batch uses the nearest one at or above it
MAX_TUNED_ROWS = 96  # past this, prefill-sized: the untuned form
TIME_PER_CASE_S = 0.004  # timing budget of one (storage, form, rows) case, after a warm-up call


def times_weight_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as torch.mm(x, W^T)."""
    return torch.mm(x, weight.t())


def weight_times_x_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as (W x^T)^T: BLAS gets the thin operand on the other side. Made
    row-major again: every later op reads rows (the sampler's reductions over
    the vocabulary ran 10x slower on the transposed logits)."""
    out = torch.mm(weight, x.t()).t()
    return out.contiguous() if x.shape[0] > 1 else out


FORMS = {"x_wt": times_weight_t, "w_xt": weight_times_x_t}


@dataclass
class MatmulChoice:
    """What the tuner chose for one weight shape."""

    column_major: bool  # store W^T contiguous (W itself is then a transposed view)
    forms: dict[int, str] = field(default_factory=dict)  # row bucket -> form name

    def form_for(self, rows: int) -> str | None:
        if rows > MAX_TUNED_ROWS:
            return None
        bucket = next((b for b in ROW_BUCKETS if rows <= b), ROW_BUCKETS[-1])
        return self.forms.get(bucket)


def cpu_matmul(x: torch.Tensor, weight: torch.Tensor, choice: MatmulChoice | None) -> torch.Tensor:
    """x W^T for a 2-D CPU activation, by the tuned form when there is one."""
    form = choice.form_for(x.shape[0]) if choice is not None else None
    # Untuned: (W x^T)^T, measured 1.3-3x faster than x W^T for 2-64 rows on an
    # AVX2 EPYC and equal for long prefills.
    return FORMS[form or "w_xt"](x, weight)


def _seconds(fn, x: torch.Tensor, weight: torch.Tensor) -> float:
    fn(x, weight)  # warm-up: first-call allocations and packing
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < TIME_PER_CASE_S:
        start = time.perf_counter()
        fn(x, weight)
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
        if calls >= 50:
            break
    return best  # the least disturbed run: the machine's other load only adds


def choose(weight: torch.Tensor) -> MatmulChoice:
    """Time every (storage order, form, row bucket) for this weight."""
    storages = {False: weight.contiguous(), True: weight.t().contiguous().t()}
    results: dict[bool, dict[int, tuple[float, str]]] = {}
    for column_major, stored in storages.items():
        per_bucket = {}
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            timed = {name: _seconds(fn, x, stored) for name, fn in FORMS.items()}
            name = min(timed, key=timed.__getitem__)
            per_bucket[rows] = (timed[name], name)
        results[column_major] = per_bucket
    # Decode batches spread over the buckets; each counts alike, as its time
    # relative to the better order (absolute sums would let 64 rows decide).
    def slowdown(column_major: bool) -> float:
        return sum(
            results[column_major][rows][0] / min(results[True][rows][0], results[False][rows][0])
            for rows in ROW_BUCKETS
        )

    column_major = slowdown(True) < slowdown(False)
    return MatmulChoice(column_major, {rows: name for rows, (_, name) in results[column_major].items()})


def tune_cpu_matmuls(modules: Iterable[torch.nn.Module]) -> dict[tuple[int, ...], MatmulChoice]:
    """Choose for every distinct weight shape among `modules` (each has a
    2-D `weight` and a `matmul_choice` attribute), then store each weight in
    its chosen order and set its choice. A weight shared by two modules (tied
    embeddings) is reordered once."""
    started = time.perf_counter()
    choices: dict[tuple[int, ...], MatmulChoice] = {}
    reordered: set[int] = set()
    with torch.inference_mode():
        for module in modules:
            weight = module.weight
            key = (*weight.shape, weight.dtype.itemsize)
            if key not in choices:
                choices[key] = choose(weight.data)
            choice = choices[key]
            module.matmul_choice = choice
            if choice.column_major and id(weight) not in reordered and weight.data.is_contiguous():
                weight.data = weight.data.t().contiguous().t()
            reordered.add(id(weight))
    for (rows, cols, _), choice in choices.items():
        order = "column-major" if choice.column_major else "row-major"
        logger.debug("matmul [%d, %d]: %s, forms %s", rows, cols, order, choice.forms)
    logger.info("tuned CPU matmuls for %d weight shapes in %.1f s", len(choices), time.perf_counter() - started)
    return choices
