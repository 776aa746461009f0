"""How close the engine's CPU steps come to this machine's own limits (issue 45).

First the machine's limits, measured here with plain torch primitives at
the engine's thread count: read bandwidth (a sum over a buffer far larger
than the last-level cache, best of N) and the matmul peak in float32 and in
half precision (bfloat16; float16 too where the CPU has float16 units) at
large shapes, the best of torch's matmul and the native packed kernel the
engine multiplies with. Then, per model (dummy weights of a published
shape), the engine's own steps, `Engine.forward` on hand-built plans as
benchmarks/roofline.py does, each set against its bound:

* batch-1 decode: bytes a step must read (weights as stored, the KV of the
  context) / read bandwidth. Goal >= 80%.
* batch-64 decode: the larger of FLOPs (2 x matmul params x 64 + attention)
  / the weights' matmul peak and bytes / bandwidth. Goal >= 50%.
* prefill: FLOPs / the weights' matmul peak. Goal >= 60%.

`fraction` is bound time / measured time, the bound taken from its limit
measured again beside the step (before, between and after the step's
repeats, the best of each): a
shared machine's speed drifts within minutes, so the limits of the run's
start alone made the same step 56% of the peak in one run and 108% in the
next; that fraction is printed beside it. The goals belong to the
benchmark, never to a test. Last, where a batch-64 decode step's time goes:
the step run once more through the modules (the DecoderStack, where the
engine takes it, is one native call with no inside to time), each module
timed by forward hooks, its time less its timed children's (exclusive);
and the scheduler's host work, from `LLM.generate` of 64 requests: the
forward thread's idle gap between two batch-64 decode steps, as a share of
gap + step.

    python benchmarks/cpu_limits.py                                  # qwen3-0.6b (bf16) and tiny-llama (fp32)
    python benchmarks/cpu_limits.py --quick --json limits.json --png limits.png
    python benchmarks/cpu_limits.py --models tinyllama-1.1b --context 1024
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package

import roofline  # noqa: E402
from dummy_model import write_dummy_model  # noqa: E402

from aioserve import LLM, SamplingParams  # noqa: E402
from aioserve.batch_plan import BatchPlan  # noqa: E402
from aioserve.cpu.dispatch import choose_math_dtype  # noqa: E402
from aioserve.cpu.isa import cpu_flags  # noqa: E402
from aioserve.cpu.native import cpu_kernels  # noqa: E402
from aioserve.cpu_engine.greedy_screen import GreedyScreen  # noqa: E402
from aioserve.cpu_engine.head_argmax import HeadArgmax  # noqa: E402
from aioserve.cpu_engine.int8_head_screen import SERVED_ROWS  # noqa: E402
from aioserve.engine.engine import Engine  # noqa: E402
from aioserve.scheduler.request import Request  # noqa: E402
from aioserve.scheduler.sampling_batch import SampleRow, SamplingBatchBuilder  # noqa: E402

logger = logging.getLogger("benchmarks.cpu_limits")
REPO = Path(__file__).resolve().parents[1]
TOKENIZERS = REPO.parent / "shared" / "tokenizers"

# The ISA flags that decide a CPU's matmul and its dtype (aioserve/cpu/dispatch.py).
FLAGS_THAT_MATTER = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
GOALS = {"decode b1": 0.80, "decode large": 0.50, "prefill": 0.60}


@dataclass(frozen=True)
class ModelSpec:
    """A model the benchmark runs: a folder (a tokenizer folder plus config
    fields for dummy weights) and the dtype its weights are stored in."""

    folder: Path
    dtype: str
    fields: dict[str, Any] = field(default_factory=dict)  # config.json overrides; empty: the folder's as is
    dummy: bool = True


MODELS: dict[str, ModelSpec] = {
    "qwen3-0.6b": ModelSpec(TOKENIZERS / "qwen3", "bfloat16"),
    # docs/performance.md's tiny-llama: stories15M's shape with Llama's 32k vocabulary.
    "tiny-llama": ModelSpec(TOKENIZERS / "tinyllama-v1.1", "float32", dict(
        num_hidden_layers=6, hidden_size=288, intermediate_size=768, num_attention_heads=6,
        num_key_value_heads=6, head_dim=48, vocab_size=32000, max_position_embeddings=4096,
        tie_word_embeddings=False)),
    "tinyllama-1.1b": ModelSpec(TOKENIZERS / "tinyllama-v1.1", "float32"),  # 4.4 GB in float32: slow on 2 cores
    "demo": ModelSpec(REPO / "aioserve" / "demo_model", "float32", dummy=False),  # stories260K's real weights
}


# ---------------------------------------------------------------- arithmetic


@dataclass(frozen=True)
class Shape:
    """What the bounds need of a dense decoder's config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, cfg: Any) -> Shape:
        return cls(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.vocab_size, bool(cfg.tie_word_embeddings))

    def layer_matmul_params(self) -> int:
        """q, k, v, o and the gated MLP's three projections of one layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    def layer_norm_params(self) -> int:
        return 2 * self.hidden  # input and post-attention RMSNorm (Qwen3's per-head q/k norms: 2 x head_dim more)

    def matmul_params(self) -> int:
        """Every weight a token multiplies through: the layers and the LM head
        (the embedding is a lookup)."""
        return self.layers * self.layer_matmul_params() + self.vocab * self.hidden

    def kv_bytes_per_token(self, kv_itemsize: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * kv_itemsize

    def attention_flops(self, queries: int, keys: int) -> int:
        """QK^T and PV, 2 FLOPs a multiply-add each, summed over (query, key) pairs."""
        return 4 * self.layers * self.heads * self.head_dim * queries * keys


def decode_bytes(shape: Shape, batch: int, context: int, weight_itemsize: int, kv_itemsize: int,
                 head_itemsize: int | None = None) -> int:
    """Bytes one decode step must read: every layer weight and the LM head
    once (the head at `head_itemsize` where the engine reads a narrower copy
    of it), `batch` embedding rows, and each request's `context` tokens of KV."""
    head = shape.vocab * shape.hidden * (head_itemsize or weight_itemsize)
    layers = shape.layers * (shape.layer_matmul_params() + shape.layer_norm_params()) * weight_itemsize
    embedding_rows = batch * shape.hidden * weight_itemsize
    return layers + head + embedding_rows + batch * context * shape.kv_bytes_per_token(kv_itemsize)


def decode_flops(shape: Shape, batch: int, context: int) -> int:
    """2 x matmul params per row, and each row's attention over `context` keys."""
    return 2 * shape.matmul_params() * batch + batch * shape.attention_flops(1, context)


def prefill_flops(shape: Shape, requests: int, length: int) -> int:
    """`requests` fresh prompts of `length` tokens: every token through the
    layers, the LM head for each prompt's last token only (the engine
    computes logits at the sampled rows), causal attention (n(n+1)/2 pairs)."""
    tokens = requests * length
    layers = 2 * shape.layers * shape.layer_matmul_params() * tokens
    head = 2 * shape.vocab * shape.hidden * requests
    return layers + head + requests * shape.attention_flops(1, length * (length + 1) // 2)


def fraction(bound_s: float, measured_s: float) -> float:
    """Share of the machine's limit reached: 1.0 is the roof."""
    return bound_s / measured_s if measured_s > 0 else 0.0


# ------------------------------------------------------------ the machine


@dataclass
class Machine:
    cpu: str
    cores: int
    logical_cpus: int
    threads: int  # torch's intra-op threads: the engine's
    flags: list[str]  # of FLAGS_THAT_MATTER, those the CPU has
    torch: str
    bandwidth: float = 0.0  # bytes/s, read: the best of bandwidth_detail
    bandwidth_detail: dict[str, float] = field(default_factory=dict)  # each read pattern timed
    matmul: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s, the best measured
    matmul_detail: list[dict[str, Any]] = field(default_factory=list)  # each shape and path timed


def cpu_model_name(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def physical_cores(cpuinfo: str) -> int:
    """Distinct (package, core) pairs; the logical count where cpuinfo lacks them."""
    pairs, package = set(), "0"
    for line in cpuinfo.splitlines():
        if line.startswith("physical id"):
            package = line.split(":", 1)[1].strip()
        elif line.startswith("core id"):
            pairs.add((package, line.split(":", 1)[1].strip()))
    return len(pairs) or (os.cpu_count() or 1)


def describe_machine(flags: frozenset[str], cpuinfo: str | None = None) -> Machine:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    return Machine(
        cpu=cpu_model_name(cpuinfo), cores=physical_cores(cpuinfo), logical_cpus=os.cpu_count() or 1,
        threads=torch.get_num_threads(), flags=[f for f in FLAGS_THAT_MATTER if f in flags],
        torch=torch.__version__,
    )


def half_dtypes(flags: frozenset[str]) -> list[torch.dtype]:
    """bfloat16 always (the checkpoints are bf16); float16 only where the
    CPU has float16 units, since torch would emulate it elsewhere."""
    return [torch.bfloat16] + ([torch.float16] if flags & {"avx512_fp16", "amx_fp16"} else [])


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls after a warm-up: a shared machine's
    interference only ever adds time."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class Probe:
    """A limit measured again beside each step: on a shared machine the
    speed it offers drifts within minutes (on a 2-core Emerald Rapids VM
    one core's AMX tiles ran the same in-L1 loop at 490-1624 GFLOP/s from
    one run to the next), so a step's fraction is taken against what the
    machine gave while that step ran (best_beside)."""

    limit: str  # "bandwidth" or "<dtype> matmul"
    work: float  # bytes read or FLOPs done by one call
    call: Callable[[], object]


def bandwidth_probe(buffer: torch.Tensor) -> Probe:
    """A float32 GEMV (torch.mv) over `buffer` as a weight, a decode step's
    own access pattern: read_bandwidth's best, and the bandwidth probe."""
    weight = buffer.view(-1, 4096) if buffer.numel() % 4096 == 0 else buffer.view(1, -1)
    vector = torch.ones(weight.shape[1])
    return Probe("bandwidth", buffer.numel() * 4, lambda: torch.mv(weight, vector))


def read_buffer(megabytes: int) -> torch.Tensor:
    """`megabytes` of float32 ones: far larger than the last-level cache at the default 1024."""
    return torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)


def read_bandwidth(megabytes: int, repeats: int) -> dict[str, float]:
    """Bytes/s of two reads of `megabytes` (reads only, as a decode step's
    weights and KV are): a float32 sum, and a float32 GEMV over a weight of
    that size (bandwidth_probe)."""
    buffer = read_buffer(megabytes)
    gemv = bandwidth_probe(buffer)
    return {
        "float32 sum": gemv.work / best_seconds(lambda: buffer.sum(), repeats),
        "float32 GEMV": gemv.work / best_seconds(gemv.call, repeats),
    }


def matmul_calls(dtype: torch.dtype, shape: tuple[int, int, int],
                 flags: frozenset[str]) -> dict[str, Callable[[], object]]:
    """x[M, K] @ W[K, N] on each path timed, by name: torch's matmul, and the
    native packed kernel with activations in the engine's math dtype for
    these weights (float32 where the CPU has no half units: half weights are
    widened in registers), which is how the engine multiplies them. Where the
    CPU has no half units torch's half matmul is emulated (minutes at 2048^3
    on 2 AVX2 cores, ten times slower than the native kernel): left out."""
    math_dtype, _ = choose_math_dtype(flags, dtype)
    kernels = cpu_kernels(wait=True)
    m, k, n = shape
    x, w = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    calls: dict[str, Callable[[], object]] = {}
    if math_dtype == dtype or kernels is None:
        calls["torch"] = lambda: x @ w
    if kernels is not None:
        packed = kernels.pack_linear_weight(w.t().contiguous())  # [N, K], as a Linear's weight
        xm = x.to(math_dtype)
        calls["native packed"] = lambda: kernels.packed_linear(xm, packed, None, n)
    return calls


def matmul_rates(dtype: torch.dtype, shapes: list[tuple[int, int, int]], repeats: int,
                 flags: frozenset[str]) -> list[dict[str, Any]]:
    """FLOP/s of each shape on each path of matmul_calls."""
    results = []
    for m, k, n in shapes:
        for path, call in matmul_calls(dtype, (m, k, n), flags).items():
            results.append({"dtype": _name(dtype), "shape": [m, k, n], "path": path,
                            "flops": 2 * m * k * n / best_seconds(call, repeats)})
    return results


def matmul_probe(machine: Machine, dtype: str) -> Probe:
    """The shape and path at which measure_machine found `dtype`'s peak."""
    best = max((d for d in machine.matmul_detail if d["dtype"] == dtype), key=lambda d: d["flops"])
    m, k, n = best["shape"]
    calls = matmul_calls(getattr(torch, dtype), (m, k, n), frozenset(machine.flags))
    return Probe(f"{dtype} matmul", 2 * m * k * n, calls[best["path"]])


def measure_machine(machine: Machine, bandwidth_mb: int, shapes: list[tuple[int, int, int]], repeats: int) -> None:
    logger.info("measuring read bandwidth over %d MiB", bandwidth_mb)
    machine.bandwidth_detail = read_bandwidth(bandwidth_mb, repeats)
    machine.bandwidth = max(machine.bandwidth_detail.values())
    for dtype in tqdm([torch.float32, *half_dtypes(frozenset(machine.flags))], desc="matmul peaks"):
        detail = matmul_rates(dtype, shapes, repeats, frozenset(machine.flags))
        machine.matmul_detail += detail
        machine.matmul[_name(dtype)] = max(d["flops"] for d in detail)
    logger.info("bandwidth %.1f GB/s; matmul %s", machine.bandwidth / 1e9,
                ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in machine.matmul.items()))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def best_beside(step: Callable[[], object], probe: Probe, repeats: int, rounds: int = 2) -> tuple[float, float]:
    """(the step's best seconds, the probe's best rate): `rounds` times the
    probe twice, then the step `repeats` times back to back (so that, as
    before, a step may find what the one before it left in the caches: a
    small model's weights stay in L3 while it serves), and the probe once
    more at the end."""
    step()
    step_s = probe_s = float("inf")

    def time_probe() -> None:
        nonlocal probe_s
        for _ in range(2):
            start = time.perf_counter()
            probe.call()
            probe_s = min(probe_s, time.perf_counter() - start)

    for _ in range(rounds):
        time_probe()
        for _ in range(max(1, repeats // rounds)):
            start = time.perf_counter()
            step()
            step_s = min(step_s, time.perf_counter() - start)
    time_probe()
    return step_s, probe.work / probe_s


# -------------------------------------------------------- the engine's steps


@dataclass
class Row:
    """One measurement against its bound."""

    model: str
    step: str  # "decode b1", "decode b64", "prefill 4x512"
    kind: str  # a GOALS key
    measured_ms: float
    bound_ms: float
    bound_by: str  # "bandwidth" or "<dtype> matmul"
    nbytes: int
    flops: int
    per_second: str  # the step's rate, e.g. "21.3 tok/s"
    limit_beside: float = 0.0  # the bounding limit (bytes/s or FLOP/s) as measured beside the step: bound_ms's
    start_bound_ms: float = 0.0  # the bound from the limits measured at the start of the run

    @property
    def fraction(self) -> float:
        return fraction(self.bound_ms, self.measured_ms)

    @property
    def start_fraction(self) -> float:
        return fraction(self.start_bound_ms, self.measured_ms)

    @property
    def goal(self) -> float:
        return GOALS[self.kind]


@dataclass
class Breakdown:
    """Where a large-batch decode step's time goes, as shares."""

    model: str
    batch: int
    module_step_ms: float  # the module path, hooks on
    engine_step_ms: float  # the engine's own path (the DecoderStack where it takes it)
    shares: dict[str, float]  # of the module-path step
    host_share: float | None  # exposed scheduler work, of a serving step (LLM.generate)
    serving_step_ms: float | None


def on_forward_thread(llm: LLM, fn: Callable[[], Any]) -> Any:
    """Run `fn` on the thread that runs the engine's steps: a second thread
    doing torch work would start a second OpenMP team, and with more
    threads than cores libgomp's workers sleep instead of spinning
    (aioserve/cpu/openmp.py). ThreadExecutor keeps that thread privately."""
    thread = getattr(llm.scheduler.executor, "_thread", None)
    return thread.submit(fn).result() if thread is not None else fn()


def prefill_plan(engine: Engine, requests: int, length: int, sampling: SamplingBatchBuilder) -> BatchPlan:
    """`requests` fresh prompts of `length` tokens in one step, each in its
    own pages, sampling each prompt's last token."""
    ps = engine.page_size
    width = -(-length // ps)
    pages = (torch.arange(requests * width) + 1).view(requests, width)  # page 0 is reserved
    positions = torch.arange(length).repeat(requests)
    slots = pages.repeat_interleave(ps, dim=1)[:, :length].reshape(-1).long() * ps + positions % ps
    ends = torch.arange(1, requests + 1) * length - 1
    return BatchPlan(
        step=0, input_ids=torch.full((requests * length,), 1, dtype=torch.long), positions=positions,
        out_cache_loc=slots, seq_lens=torch.full((requests,), length, dtype=torch.long),
        extend_lens=torch.full((requests,), length, dtype=torch.long), page_table=pages.int(), num_decodes=0,
        logits_indices=ends, sampling=sampling.build(_rows(requests)),
    )


def _rows(n: int) -> list[SampleRow]:
    """Greedy rows: the cheapest sampler, as roofline.decode_plan's."""
    return [SampleRow(Request(f"r{i}", [1], SamplingParams(temperature=0), lambda e: None), 0, None) for i in range(n)]


def head_itemsize(engine: Engine, batch: int) -> int | None:
    """Bytes per LM-head weight a greedy step reads: the greedy screen's
    half copy, or a bf16 head's int8 copy, where it serves `batch` rows,
    else None (the head as stored). (The int8 screen's kept blocks, a few
    of the head's, are not counted.)"""
    screen = engine.greedy_screen
    if isinstance(screen, HeadArgmax) and screen.int8 is not None and batch <= SERVED_ROWS:
        return screen.int8.copy.screen.element_size()
    if not isinstance(screen, GreedyScreen) or (screen.max_rows is not None and batch > screen.max_rows):
        return None
    return screen.screen.element_size()


def weight_itemsize(engine: Engine) -> int:
    return engine.weight_dtype.itemsize


def decode_row(engine: Engine, name: str, batch: int, context: int, repeats: int, kind: str,
               machine: Machine, probes: dict[str, Probe]) -> Row:
    """The step against the larger of its bytes / bandwidth and its FLOPs /
    the weights' matmul peak (batch 1: bandwidth alone, the issue's goal),
    the bounding limit measured again beside the step (Probe)."""
    shape = Shape.of(engine.model_config)
    sampling = SamplingBatchBuilder(shape.vocab, engine.model_config.eos_token_ids, 0)
    plan = roofline.decode_plan(engine, batch, context, sampling)
    roofline.fill_kv(engine, plan)  # written pages: untouched memory reads as one cached zero page
    nbytes = decode_bytes(shape, batch, context, weight_itemsize(engine), engine.kv_dtype.itemsize,
                          head_itemsize(engine, batch))
    flops = decode_flops(shape, batch, context)
    peak_dtype = _name(engine.weight_dtype)
    memory_bound = kind == "decode b1" or nbytes / machine.bandwidth >= flops / machine.matmul[peak_dtype]
    probe = probes["bandwidth"] if memory_bound else probes[f"{peak_dtype} matmul"]
    work, start_limit = (nbytes, machine.bandwidth) if memory_bound else (flops, machine.matmul[peak_dtype])
    seconds, limit = best_beside(lambda: engine.forward(plan), probe, repeats)
    return Row(name, f"decode b{batch} ctx{context}", kind, seconds * 1e3, work / limit * 1e3, probe.limit, nbytes,
               flops, f"{batch / seconds:.1f} tok/s", limit, work / start_limit * 1e3)


def prefill_row(engine: Engine, name: str, requests: int, length: int, repeats: int, machine: Machine,
                probes: dict[str, Probe]) -> Row:
    """The chunk's FLOPs against the weights' matmul peak, measured again beside it."""
    shape = Shape.of(engine.model_config)
    sampling = SamplingBatchBuilder(shape.vocab, engine.model_config.eos_token_ids, 0)
    plan = prefill_plan(engine, requests, length, sampling)
    flops = prefill_flops(shape, requests, length)
    peak_dtype = _name(engine.weight_dtype)
    probe = probes[f"{peak_dtype} matmul"]
    seconds, limit = best_beside(lambda: engine.forward(plan), probe, repeats)
    tokens = requests * length
    return Row(name, f"prefill {requests}x{length}", "prefill", seconds * 1e3, flops / limit * 1e3, probe.limit,
               decode_bytes(shape, 0, 0, weight_itemsize(engine), 1) + tokens * shape.kv_bytes_per_token(
                   engine.kv_dtype.itemsize), flops, f"{tokens / seconds:.0f} tok/s", limit,
               flops / machine.matmul[peak_dtype] * 1e3)


# ------------------------------------------------------ where the time goes

# Module class names -> category; a module's time less its timed children's goes to its category.
CATEGORIES = (("LMHead", "matmul"), ("Linear", "matmul"), ("Norm", "norms"), ("Rotary", "rope"),
              ("Attention", "attention"), ("MLP", "activation"), ("Embedding", "embedding"))


def category_of(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    return next((cat for key, cat in CATEGORIES if key in name), None)


class ExclusiveTimer:
    """Nested wall-clock sections; each category gets its sections' time
    less the time of the sections timed inside them."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [category, start, children's time]

    def enter(self, category: str) -> None:
        self._stack.append([category, time.perf_counter(), 0.0])

    def leave(self) -> None:
        category, start, children = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.totals[category] = self.totals.get(category, 0.0) + elapsed - children
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextmanager
    def section(self, category: str) -> Iterator[None]:
        self.enter(category)
        try:
            yield
        finally:
            self.leave()

    def shares(self) -> dict[str, float]:
        total = sum(self.totals.values())
        return {k: v / total for k, v in sorted(self.totals.items(), key=lambda kv: -kv[1])} if total else {}


@contextmanager
def module_path_timed(engine: Engine, timer: ExclusiveTimer) -> Iterator[None]:
    """The engine's steps through its modules (no DecoderStack), every
    categorised module and the sampler timed."""
    handles = []
    for module in engine.model.modules():
        category = category_of(module)
        if category is not None:
            handles.append(module.register_forward_pre_hook(lambda m, a, c=category: timer.enter(c)))
            handles.append(module.register_forward_hook(lambda m, a, o: timer.leave()))
    runner, engine.graph_runner = engine.graph_runner, None
    tokens = engine._tokens  # the sampler, the greedy screen and the LM head's call

    def timed_tokens(*args: Any) -> Any:
        with timer.section("sampling"):
            return tokens(*args)

    engine._tokens = timed_tokens  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del engine._tokens
        engine.graph_runner = runner
        for handle in handles:
            handle.remove()


def step_breakdown(engine: Engine, batch: int, context: int, repeats: int) -> tuple[dict[str, float], float]:
    """(shares, module-path step seconds) of a `batch` decode step."""
    sampling = SamplingBatchBuilder(engine.vocab_size, engine.model_config.eos_token_ids, 0)
    plan = roofline.decode_plan(engine, batch, context, sampling)
    roofline.fill_kv(engine, plan)
    timer = ExclusiveTimer()
    with module_path_timed(engine, timer):
        engine.forward(plan)  # warm-up, then only the timed steps count
        timer.totals.clear()
        start = time.perf_counter()
        for _ in range(repeats):
            with timer.section("other (embedding, plan, layer glue)"):
                engine.forward(plan)
        seconds = (time.perf_counter() - start) / repeats
    return timer.shares(), seconds


def host_share(llm: LLM, batch: int, prompt_len: int, output_len: int) -> tuple[float, float] | None:
    """(exposed host share, serving step seconds) of `batch`-row decode steps
    in LLM.generate: the forward thread's idle gap between two of them (the
    scheduler's work overlap did not hide) over gap + step. None if no two
    such steps ran back to back."""
    engine = llm.engine
    calls: list[tuple[float, float, int, int]] = []  # start, end, decodes, tokens
    forward = engine.forward

    def recorded(plan: BatchPlan) -> Any:
        start = time.perf_counter()
        try:
            return forward(plan)
        finally:
            calls.append((start, time.perf_counter(), plan.num_decodes, int(plan.input_ids.shape[0])))

    low = min(1000, engine.vocab_size // 4)
    prompts = [[low + (i * 7 + j) % (engine.vocab_size // 4) for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.forward = recorded  # type: ignore[method-assign]
    try:
        llm.generate(prompts, params)
    finally:
        del engine.forward
    gaps, steps = [], []
    for before, after in zip(calls, calls[1:]):
        if before[2] == before[3] == after[2] == after[3] == batch:
            gaps.append(after[0] - before[1])
            steps.append(after[1] - after[0])
    if not gaps:
        return None
    gap, step = statistics.median(gaps), statistics.median(steps)
    return gap / (gap + step), gap + step


# ------------------------------------------------------------------- models


@dataclass
class Sizes:
    """How much each measurement does: --quick shrinks it."""

    bandwidth_mb: int
    matmul_shapes: list[tuple[int, int, int]]
    limit_repeats: int
    context: int
    large_batch: int
    prefill: tuple[int, int]  # requests, tokens each
    decode_repeats: int
    prefill_repeats: int
    breakdown_repeats: int
    host_prompt: int
    host_output: int


FULL = Sizes(1024, [(64, 4096, 4096), (2048, 2048, 2048)], 5, 512, 64, (4, 512), 5, 2, 3, 16, 16)
QUICK = Sizes(256, [(64, 2048, 2048), (1024, 1024, 1024)], 3, 512, 64, (1, 256), 2, 1, 1, 4, 6)


def build_llm(name: str, spec: ModelSpec, sizes: Sizes, workdir: Path, num_threads: int | None,
              paths: dict[str, str] | None = None) -> LLM:
    folder = spec.folder
    if spec.fields:
        folder = write_dummy_model(spec.folder, workdir / name, spec.fields)
    ps = 16
    decode_pages = sizes.large_batch * -(-(sizes.context + 1) // ps)
    prefill_pages = sizes.prefill[0] * -(-sizes.prefill[1] // ps)
    host_pages = sizes.large_batch * -(-(sizes.host_prompt + sizes.host_output + 1) // ps)
    options: dict[str, Any] = dict(
        dtype=spec.dtype, page_size=ps, num_pages=max(decode_pages, prefill_pages, host_pages) + 8,
        max_running_requests=max(sizes.large_batch, 1),
    )
    if spec.dummy:
        options["load_format"] = "dummy"
    if num_threads:
        options["num_threads"] = num_threads
    options.update(paths or {})  # --cpu-matmul / --cpu-half-compute: a path forced, to set beside auto's
    return LLM(str(folder), **options)


def dispatch_lines(engine: Engine) -> list[str]:
    dispatch = engine.cpu_dispatch
    return dispatch.lines() if dispatch is not None else [f"not a CPU engine ({engine.device})"]


def measure_model(llm: LLM, name: str, sizes: Sizes, machine: Machine) -> tuple[list[Row], Breakdown]:
    engine = llm.engine

    def steps() -> tuple[list[Row], tuple[dict[str, float], float]]:
        peak_dtype = _name(engine.weight_dtype)
        probes = {"bandwidth": bandwidth_probe(read_buffer(sizes.bandwidth_mb)),
                  f"{peak_dtype} matmul": matmul_probe(machine, peak_dtype)}
        with tqdm(total=4, desc=name) as bar:
            rows = [decode_row(engine, name, 1, sizes.context, sizes.decode_repeats * 2, "decode b1", machine, probes)]
            bar.update()
            rows.append(decode_row(engine, name, sizes.large_batch, sizes.context, sizes.decode_repeats,
                                   "decode large", machine, probes))
            bar.update()
            rows.append(prefill_row(engine, name, *sizes.prefill, sizes.prefill_repeats, machine, probes))
            bar.update()
            parts = step_breakdown(engine, sizes.large_batch, sizes.context, sizes.breakdown_repeats)
            bar.update()
        return rows, parts

    rows, (shares, module_s) = on_forward_thread(llm, steps)
    host = host_share(llm, sizes.large_batch, sizes.host_prompt, sizes.host_output)
    breakdown = Breakdown(name, sizes.large_batch, module_s * 1e3, rows[1].measured_ms, shares,
                          host[0] if host else None, host[1] * 1e3 if host else None)
    return rows, breakdown


# ------------------------------------------------------------------- output


def limits_table(machine: Machine) -> str:
    lines = [f"CPU: {machine.cpu}; {machine.cores} cores, {machine.logical_cpus} logical CPUs; torch "
             f"{machine.torch} on {machine.threads} threads; flags: {' '.join(machine.flags) or '(none of note)'}",
             "", "| limit | measured | how |", "|---|---|---|",
             f"| read bandwidth | {machine.bandwidth / 1e9:.1f} GB/s | best of "
             + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in machine.bandwidth_detail.items()) + " |"]
    for dtype, rate in machine.matmul.items():
        best = max((d for d in machine.matmul_detail if d["dtype"] == dtype), key=lambda d: d["flops"])
        shape = "x".join(map(str, best["shape"]))
        lines.append(f"| {dtype} matmul peak | {rate / 1e9:.1f} GFLOP/s | {best['path']}, {shape} |")
    return "\n".join(lines)


def rows_table(rows: list[Row]) -> str:
    """Each step against its bound from the limit measured beside it (the
    goal's fraction), and against the limits measured at the start."""
    lines = ["| model | step | measured ms | rate | bound ms | bound by (beside the step) | fraction | "
             "vs the limits at start | goal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "met" if r.fraction >= r.goal else "not met"
        rate = r.limit_beside / 1e9
        unit = f"{rate:.1f} GB/s" if r.bound_by == "bandwidth" else f"{rate:.0f} GFLOP/s"
        lines.append(f"| {r.model} | {r.step} | {r.measured_ms:.2f} | {r.per_second} | {r.bound_ms:.2f} | "
                     f"{r.bound_by}, {unit} | {r.fraction:.0%} | {r.start_fraction:.0%} | {r.goal:.0%} ({mark}) |")
    return "\n".join(lines)


def breakdown_table(parts: list[Breakdown]) -> str:
    lines = ["| model | batch | module-path step ms | engine step ms | shares of the module-path step | "
             "host share of a serving step |", "|---|---|---|---|---|---|"]
    for b in parts:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in b.shares.items())
        host = f"{b.host_share:.0%} of {b.serving_step_ms:.1f} ms" if b.host_share is not None else "n/a"
        lines.append(f"| {b.model} | {b.batch} | {b.module_step_ms:.2f} | {b.engine_step_ms:.2f} | {shares} | {host} |")
    return "\n".join(lines)


def report_json(machine: Machine, rows: list[Row], parts: list[Breakdown], dispatch: dict[str, list[str]]) -> dict:
    return {
        "machine": asdict(machine),
        "rows": [asdict(r) | {"fraction": r.fraction, "start_fraction": r.start_fraction, "goal": r.goal}
                 for r in rows],
        "breakdown": [asdict(b) for b in parts],
        "cpu_dispatch": dispatch,
    }


def plot(rows: list[Row], path: str) -> None:
    import matplotlib  # lazily: only --png needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.model}\n{r.step}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    ax.bar(range(len(rows)), [r.fraction for r in rows], label="fraction of the bound")
    ax.scatter(range(len(rows)), [r.goal for r in rows], marker="_", s=600, color="red", label="goal", zorder=3)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="bound time / measured time", ylim=(0, max(1.0, *(r.fraction for r in rows)) * 1.1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "tiny-llama"], choices=list(MODELS))
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller buffers and prefill: ~2 min on 2 cores")
    p.add_argument("--context", type=int, help="KV tokens of each decoding request (default 512)")
    p.add_argument("--large-batch", type=int, help="the large decode batch (default 64)")
    p.add_argument("--prefill", type=int, nargs=2, metavar=("REQUESTS", "TOKENS"), help="default 4 512 (quick 1 256)")
    p.add_argument("--bandwidth-mb", type=int, help="the read buffer (default 1024, quick 256)")
    p.add_argument("--matmul-shapes", nargs="+", metavar="MxKxN", help="default 64x4096x4096 2048x2048x2048")
    p.add_argument("--num-threads", type=int, help="the engine's threads (default: its own choice)")
    p.add_argument("--cpu-matmul", choices=["auto", "native", "onednn", "blas"], default="auto",
                   help="force the engine's CPU matmul path (aioserve serve --cpu-matmul)")
    p.add_argument("--cpu-half-compute", choices=["auto", "native", "float32"], default="auto",
                   help="force half models' math dtype (aioserve serve --cpu-half-compute)")
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--png", help="write a bar chart of fractions against goals here")
    return p.parse_args(argv)


def sizes_of(args: argparse.Namespace) -> Sizes:
    base = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    for name in ("context", "large_batch", "bandwidth_mb"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.prefill:
        changes["prefill"] = tuple(args.prefill)
    if args.matmul_shapes:
        changes["matmul_shapes"] = [tuple(int(x) for x in s.lower().split("x")) for s in args.matmul_shapes]
    return Sizes(**{**asdict(base), **changes})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sizes = sizes_of(args)
    flags = cpu_flags()
    rows: list[Row] = []
    parts: list[Breakdown] = []
    dispatch: dict[str, list[str]] = {}
    machine: Machine | None = None
    start = time.perf_counter()
    paths = {"cpu_matmul": args.cpu_matmul, "cpu_half_compute": args.cpu_half_compute}
    with tempfile.TemporaryDirectory(prefix="cpu_limits-") as workdir:
        for name in args.models:
            llm = build_llm(name, MODELS[name], sizes, Path(workdir), args.num_threads, paths)
            try:
                if machine is None:  # on the forward thread, at the engine's thread count (see on_forward_thread)
                    machine = on_forward_thread(llm, lambda: describe_machine(flags))
                    on_forward_thread(llm, lambda: measure_machine(
                        machine, sizes.bandwidth_mb, sizes.matmul_shapes, sizes.limit_repeats))
                dispatch[name] = dispatch_lines(llm.engine)
                for line in dispatch[name]:
                    logger.info("%s cpu_dispatch: %s", name, line)
                model_rows, breakdown = measure_model(llm, name, sizes, machine)
                rows += model_rows
                parts.append(breakdown)
            finally:
                llm.close()
    assert machine is not None
    print(limits_table(machine))
    print()
    for name, lines in dispatch.items():
        print(f"{name}: " + "; ".join(lines))
    print()
    print(rows_table(rows))
    print()
    print(breakdown_table(parts))
    logger.info("measured in %.0f s%s", time.perf_counter() - start, " (--quick)" if args.quick else "")
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(machine, rows, parts, dispatch), indent=2))
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
