"""How each weight is multiplied on the CPU, chosen by timing at load.

A decode step multiplies thin activations (1 to a few dozen rows) by tall
weights, and which BLAS call is fast for that varies by machine, shape and
row count more than any rule captures: on one AVX-512 box the tiny-llama LM
head ([32000, 288], one row) took 4.8 ms as x @ W^T from row-major W and
1.5 ms from the same weight stored column-major, while with four rows the
row-major (W x^T)^T was 3.5x faster than either, and with 16 rows oneDNN's
inner product beat all of them by 2x. So, once per weight shape,
`tune_cpu_matmuls` times both storage orders and every call form at a few row
counts, keeps the storage order that wins overall (the weight is stored once,
in that order; its logical shape stays [out, in], so everything else that
reads it, a tied embedding included, is unchanged) and, per row count, the
faster form. Larger batches (prefill) use the untuned form.

When the native kernels are built (aioserve/cpu/native.py), none of that is
needed: every weight is packed once into column blocks (native/gemm.cpp) and
multiplied by one kernel at every row count, 1.3-3x faster than the best
BLAS form for 1-16 rows in a decode step and within 10% of it for prefill.
The packed tensor replaces the weight's data (see `is_packed`, and
`packed_rows` for a tied embedding's lookups), in the checkpoint's width:
bf16 weights computed in float32 are read as bf16 and widened in registers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from aioserve.cpu.isa import cpu_flags_line
from aioserve.cpu.native import cpu_kernels

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 16, 64)  # row counts timed; a batch uses the nearest one at or above it
MAX_TUNED_ROWS = 96  # past this, prefill-sized: the untuned form
LARGE_WEIGHT_BYTES = 64 << 20  # past this, only the stored order is timed (see choose)
TIME_PER_CASE_S = 0.01  # timing budget of one (storage, form, rows) case, after a warm-up call


def times_weight_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as torch.mm(x, W^T)."""
    return torch.mm(x, weight.t())


def weight_times_x_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as (W x^T)^T: BLAS gets the thin operand on the other side. Made
    row-major again: every later op reads rows (the sampler's reductions over
    the vocabulary ran 10x slower on the transposed logits)."""
    out = torch.mm(weight, x.t()).t()
    return out.contiguous() if x.shape[0] > 1 else out


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T by oneDNN's inner product (the kernel torch.compile's CPU backend
    uses): up to 2-3x faster than MKL's sgemm for 4-64 rows on AVX-512."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def onednn_reorder(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] in oneDNN's blocked layout for its inner product (no row-count
    hint: one layout serves decode and prefill); an opaque `_mkldnn` tensor."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def onednn_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) from a weight in oneDNN's layout: no reorder in the call."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


FORMS = {"x_wt": times_weight_t, "w_xt": weight_times_x_t}
if torch.backends.mkldnn.is_available():
    FORMS["onednn"] = onednn_linear


@dataclass
class MatmulChoice:
    """What the tuner chose for one weight shape."""

    column_major: bool  # store W^T contiguous (W itself is then a transposed view)
    forms: dict[int, str] = field(default_factory=dict)  # row bucket -> form name
    packed_features: int | None = None  # packed for the native kernel: W's true row count
    # Timed faster in oneDNN's layout (column_major and forms then describe
    # the row-major fallback, should the reorder be refused).
    onednn: bool = False
    onednn_weight: torch.Tensor | None = None  # W reordered once for oneDNN (cpu/onednn_weights.py)

    def form_for(self, rows: int) -> str | None:
        if rows > MAX_TUNED_ROWS:
            return None
        bucket = next((b for b in ROW_BUCKETS if rows <= b), ROW_BUCKETS[-1])
        return self.forms.get(bucket)


def is_packed(weight: torch.Tensor) -> bool:
    """[blocks, in, block], or [blocks, in / 2, block, 2] (bf16 in k pairs)."""
    return weight.dim() >= 3


def packed_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed weight, [len(ids), in]: a tied embedding's lookup."""
    block = weight.shape[2]
    return weight[ids // block, :, ids % block].reshape(*ids.shape, -1)


def cpu_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    choice: MatmulChoice | None,
    bias: torch.Tensor | None = None,
    float_out: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ b) for a 2-D CPU activation, by the tuned form when there is one.
    `float_out`: the packed kernel may write float32 holding x's dtype's
    rounding (the same values as its x-dtype output widened); other forms
    return x's dtype. `out`: where the packed kernel writes, when given (a
    contiguous [rows, packed_features] of its output dtype); other forms
    return a new tensor."""
    if choice is not None and choice.packed_features is not None:
        kernels = cpu_kernels()
        assert kernels is not None  # a weight is packed only once the kernels are built
        return kernels.packed_linear(x, weight, bias, choice.packed_features, float_out, out)
    if choice is not None and choice.onednn_weight is not None:
        return onednn_packed_linear(x, choice.onednn_weight, bias)
    out = _unpacked_matmul(x, weight, choice)
    return out + bias if bias is not None else out


def _unpacked_matmul(x: torch.Tensor, weight: torch.Tensor, choice: MatmulChoice | None) -> torch.Tensor:
    form = choice.form_for(x.shape[0]) if choice is not None else None
    # Untuned: (W x^T)^T, measured 1.3-3x faster than x W^T for 2-64 rows on an
    # AVX2 EPYC and equal for long prefills.
    return FORMS[form or "w_xt"](x, weight)


def _seconds(fn, x: torch.Tensor, weight: torch.Tensor, to_beat: float) -> float:
    """The fastest of a few timed calls. A large weight gets fewer calls, and a
    form clearly slower than `to_beat` (the best so far) is dropped after
    one: timing is what a first start waits for. A form this CPU cannot run
    (oneDNN has no bf16 inner product without AVX512-BF16) is never chosen."""
    try:
        fn(x, weight)  # warm-up: first-call allocations and packing
    except RuntimeError:
        return float("inf")
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 5 or spent < TIME_PER_CASE_S:
        start = time.perf_counter()
        fn(x, weight)
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
        if calls >= 50 or took > 2 * to_beat or (calls >= 2 and spent > 10 * TIME_PER_CASE_S):
            break
    return best  # the least disturbed run: the machine's other load only adds


ONEDNN = "onednn"  # the storage (and form) of a weight reordered for oneDNN


def choose(weight: torch.Tensor, onednn: bool = False) -> MatmulChoice:
    """Time every (storage, form, row bucket) for this weight: row-major and
    column-major storage under each BLAS form, and with `onednn` the weight
    reordered for oneDNN under its inner product. A very large one (an LM
    head over a big vocabulary) is read at memory speed whichever order it
    has (Qwen3's [151936, 1024]: 19-21 ms a row in every form), so only its
    stored order is timed: the other would cost a copy of it and seconds of
    a first start for nothing."""
    storages: dict[bool | str, torch.Tensor] = {False: weight.contiguous()}
    if weight.numel() * weight.element_size() <= LARGE_WEIGHT_BYTES:
        storages[True] = weight.t().contiguous().t()
    if onednn:
        try:
            storages[ONEDNN] = onednn_reorder(weight)
        except RuntimeError:  # this CPU's oneDNN has no such layout (bf16 without AVX-512): never chosen
            pass
    results: dict[bool | str, dict[int, tuple[float, str]]] = {}
    for storage, stored in storages.items():
        forms = {ONEDNN: onednn_packed_linear} if storage == ONEDNN else FORMS
        per_bucket = {}
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            best = (float("inf"), "")
            for name, fn in forms.items():
                best = min(best, (_seconds(fn, x, stored, best[0]), name))
            per_bucket[rows] = best
        results[storage] = per_bucket
    # Decode batches spread over the buckets; each counts alike, as its time
    # relative to the better storage (absolute sums would let 64 rows decide).
    def slowdown(storage: bool | str) -> float:
        return sum(
            results[storage][rows][0] / min(timed[rows][0] for timed in results.values())
            for rows in ROW_BUCKETS
        )

    winner = min(results, key=slowdown)
    if winner == ONEDNN:  # the row-major forms stay as the fallback
        return MatmulChoice(False, {rows: name for rows, (_, name) in results[False].items()}, onednn=True)
    return MatmulChoice(winner is True, {rows: name for rows, (_, name) in results[winner].items()})


def cache_path() -> Path:
    """Where choices are kept between starts (AIOSERVE_MATMUL_CACHE overrides):
    timing a large model's weights takes seconds, and its result only changes
    with the machine, the torch build and the thread count."""
    configured = os.environ.get("AIOSERVE_MATMUL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "aioserve" / "cpu_matmul.json"


def _machine_key() -> str:
    text = f"{cpu_flags_line()}|{torch.__version__}|{torch.get_num_threads()}|{sorted(FORMS)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ChoiceCache:
    """Tuned choices on disk, one JSON object keyed by machine and weight shape."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.machine = _machine_key()
        try:
            self.entries: dict[str, Any] = json.loads(path.read_text())  # a file's entries are checked on reading
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def _key(self, shape: tuple[int, ...], onednn: bool) -> str:
        # Timed with oneDNN's layout as a candidate or without: two choices.
        return f"{self.machine}:{'x'.join(map(str, shape))}{':onednn' if onednn else ''}"

    def get(self, shape: tuple[int, ...], onednn: bool = False) -> MatmulChoice | None:
        entry: Any = self.entries.get(self._key(shape, onednn))
        try:
            forms = {int(rows): name for rows, name in entry["forms"].items()}
            if set(forms) == set(ROW_BUCKETS) and set(forms.values()) <= set(FORMS):
                return MatmulChoice(bool(entry["column_major"]), forms, onednn=onednn and bool(entry.get("onednn")))
        except (TypeError, KeyError, ValueError, AttributeError):
            pass
        return None

    def put(self, shape: tuple[int, ...], choice: MatmulChoice, onednn: bool = False) -> None:
        self.entries[self._key(shape, onednn)] = {
            "column_major": choice.column_major, "forms": choice.forms, "onednn": choice.onednn,
        }
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(self.entries, indent=1))
            temporary.replace(self.path)  # atomic: ranks tuning at once never see half a file
        except OSError as exc:
            logger.warning("cannot keep the matmul choices in %s: %s", self.path, exc)


class MatmulModule(Protocol):
    """A layer whose matmul is packed or tuned here (layers/linear.py, the LM head)."""

    weight: torch.Tensor
    matmul_choice: MatmulChoice | None


def pack_cpu_weights(modules: Iterable[MatmulModule], storage_dtype: torch.dtype | None = None) -> bool:
    """Pack every module's weight for the native kernel and set its choice;
    False (nothing done) when the kernels are not built: the caller tunes
    instead. Whether to pack at all is cpu/dispatch.py's choice.
    `storage_dtype`, when narrower than the weights, is what their values
    were rounded to: they are packed in it, exactly, and read at its width.
    A weight shared by two modules is packed once."""
    kernels = cpu_kernels(wait=False)
    modules = list(modules)
    if kernels is None or not modules:
        return False
    started = time.perf_counter()
    features: dict[int, int] = {}  # id(weight) -> its row count before packing
    with torch.inference_mode():
        for module in modules:
            weight = module.weight
            if id(weight) not in features:
                features[id(weight)] = weight.shape[0]
                data = weight.data
                if storage_dtype is not None and storage_dtype.itemsize < data.dtype.itemsize:
                    data = data.to(storage_dtype)
                weight.data = kernels.pack_linear_weight(data)
            module.matmul_choice = MatmulChoice(False, packed_features=features[id(weight)])
    logger.info("CPU weights packed for the native matmul in %.2f s", time.perf_counter() - started)
    return True


def tune_cpu_matmuls(modules: Iterable[MatmulModule], onednn: bool = False) -> dict[tuple[int, ...], MatmulChoice]:
    """Choose for every distinct weight shape among `modules` (each has a
    2-D `weight` and a `matmul_choice` attribute), then store each weight in
    its chosen order and set its choice. A weight shared by two modules (tied
    embeddings) is reordered once. `onednn`: oneDNN's layout is a candidate;
    a weight it wins stays row-major here, and its choice says `onednn`
    (cpu/onednn_weights.py's pack_for_onednn reorders it)."""
    started = time.perf_counter()
    cache = ChoiceCache(cache_path())
    choices: dict[tuple[int, ...], MatmulChoice] = {}
    reordered: set[int] = set()
    timed = 0
    with torch.inference_mode():
        for module in modules:
            weight = module.weight
            key = (*weight.shape, weight.dtype.itemsize)
            if key not in choices:
                cached = cache.get(key, onednn)
                if cached is None:
                    cached = choose(weight.data, onednn)
                    cache.put(key, cached, onednn)
                    timed += 1
                choices[key] = cached
            choice = choices[key]
            module.matmul_choice = choice
            if choice.column_major and id(weight) not in reordered and weight.data.is_contiguous():
                weight.data = weight.data.t().contiguous().t()
            reordered.add(id(weight))
    for (rows, cols, _), choice in choices.items():
        order = "oneDNN's layout" if choice.onednn else "column-major" if choice.column_major else "row-major"
        logger.debug("matmul [%d, %d]: %s, forms %s", rows, cols, order, choice.forms)
    cache.save()
    logger.info(
        "CPU matmuls for %d weight shapes (%d timed, the rest from %s) in %.1f s",
        len(choices), timed, cache.path, time.perf_counter() - started,
    )
    return choices
