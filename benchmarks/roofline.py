"""How close a decode step comes to this machine's limits.

For a model, batch sizes and a context length it prints, per batch size:
the bytes a decode step must read (weights once, plus every request's KV)
over the *measured* memory bandwidth, the FLOPs it must do over the
*measured* matmul rate, the larger of the two (the roofline bound), and the
measured step (Engine.forward on a decode-only plan, sampling included) and
its ratio to the bound. Nothing is assumed about the machine: both rates are
measured here, with the engine's thread count and compute dtype.

On CUDA the rates are the device's (a device-to-device copy, read + write;
a large matmul timed with CUDA events), and each step is timed three ways:
`step ms`, back-to-back launches synchronized at the end (the steady state
of overlapped serving: the larger of host and device time); `host ms`, how
long `engine.launch(plan)` takes to return (enqueueing, no sync); and
`gpu ms`, the device's own time for the step, between CUDA events, with a
spin kernel queued ahead so the host is done enqueueing before the step's
first kernel starts (the issue's goal: host ms below gpu ms at batch 1).

    python benchmarks/roofline.py --model ../shared/models/stories260K --batch 1 16 64 --context 128
    python benchmarks/roofline.py --model ../shared/tokenizers/qwen3 --load-format dummy --batch 1 64 --plot roof.png
    python benchmarks/roofline.py --model .gpu_models/qwen3 --load-format dummy --dtype bfloat16 \\
        --batch 1 16 64 256 --context 512 --json roof.json          # on a GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, is_dataclass, replace

import torch
from tqdm import tqdm

from aioserve.batch_plan import BatchPlan
from aioserve.cli import add_options, engine_config
from aioserve.config import EngineConfig
from aioserve.cpu_engine.greedy_screen import GreedyScreen
from aioserve.engine.engine import Engine
from aioserve.cpu.native import cpu_kernels
from aioserve.sampling_params import SamplingParams
from aioserve.scheduler.request import Request
from aioserve.scheduler.sampling_batch import SampleRow, SamplingBatchBuilder

logger = logging.getLogger("benchmarks.roofline")


@dataclass
class Row:
    batch: int
    context: int
    bytes_per_step: float
    flops_per_step: float
    memory_bound_ms: float
    compute_bound_ms: float
    bound_ms: float
    measured_ms: float
    # CUDA only (None on CPU, and then left out of the JSON and the table).
    host_launch_ms: float | None = None  # engine.launch(plan) until it returns, no sync
    gpu_ms: float | None = None  # the step's device time, between CUDA events

    @property
    def of_bound(self) -> float:
        return self.bound_ms / self.measured_ms


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _cuda_timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of `fn` on the current CUDA stream, between events
    (after a warm-up call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measured_bandwidth(device: torch.device, megabytes: int = 512) -> float:
    """Bytes per second of memory traffic that a large buffer reaches.
    CPU: a full read (a sum: reads only, as a decode step's weight and KV
    traffic is). CUDA: a device-to-device copy, whose read + write bytes
    are counted (the usual copy-bandwidth figure: a GPU's reads alone are
    hard to isolate, and HBM serves both at the same rate); 2 GiB, far
    beyond L2."""
    if device.type == "cuda":
        source = torch.empty(2048 * (1 << 20), dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        return 2 * source.numel() / _cuda_timed(lambda: target.copy_(source), 10)
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    seconds = _timed(lambda: buffer.sum(), 5)
    return buffer.numel() * 4 / seconds


def measured_matmul_rate(dtype: torch.dtype, device: torch.device, size: int = 1024) -> float:
    """Peak FLOP/s of a matmul in `dtype` at a shape large enough that
    overheads vanish: the compute roof (thin decode shapes sit under it). On
    CPU the faster of torch's and the native packed kernel's.
    On CUDA at 8192 (1024 would leave tensor cores half idle)."""
    if device.type == "cuda":
        size = 8192
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        return 2 * size**3 / _cuda_timed(lambda: a @ b, 20)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    rate = 2 * size**3 / _timed(lambda: a @ b, 10)
    kernels = cpu_kernels(wait=False)
    if kernels is not None:  # the packed kernel the engine uses can beat torch's (bf16 pairs: ~2x)
        packed = kernels.pack_linear_weight(b)
        rate = max(rate, 2 * size**3 / _timed(lambda: kernels.packed_linear(a, packed, None, size), 10))
    return rate


def step_cost(engine: Engine, batch: int, context: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `batch` requests at `context`."""
    cfg = engine.model_config
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    matmul_params = sum(p.numel() for p in engine.model.parameters() if p.dim() >= 2)  # packed: 3-D
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if not tied:  # the input embedding is a lookup, not a matmul: a step reads `batch` rows of it
        matmul_params -= cfg.vocab_size * cfg.hidden_size
        weights -= (cfg.vocab_size - batch) * cfg.hidden_size * engine.dtype.itemsize  # stored in compute dtype
    screen = engine.greedy_screen
    if isinstance(screen, GreedyScreen):  # greedy rows read the LM head's half copy, not the float32 head
        weights -= screen.exact.nbytes - screen.screen.nbytes
    kv_heads = engine.pool.num_kv_heads
    kv_bytes = batch * context * cfg.num_layers * 2 * kv_heads * cfg.head_dim * engine.kv_dtype.itemsize
    attention_flops = 4 * batch * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return weights + kv_bytes, 2 * matmul_params * batch + attention_flops


def decode_plan(engine: Engine, batch: int, context: int, sampling: SamplingBatchBuilder) -> BatchPlan:
    """`batch` requests, each with `context` tokens of KV already in distinct pages."""
    ps = engine.page_size
    width = -(-context // ps)
    pages = (torch.arange(batch * width) + 1).view(batch, width)  # page 0 is reserved
    last = torch.full((batch,), context - 1, dtype=torch.long)
    rows = [SampleRow(Request(f"r{i}", [1], SamplingParams(temperature=0), lambda e: None), 0, None) for i in range(batch)]
    return BatchPlan(
        step=0,
        input_ids=torch.full((batch,), 1, dtype=torch.long),
        positions=last,
        out_cache_loc=pages[:, -1].long() * ps + (context - 1) % ps,
        seq_lens=last + 1,
        extend_lens=torch.ones(batch, dtype=torch.long),
        page_table=pages.int(),
        num_decodes=batch,
        logits_indices=torch.arange(batch),
        sampling=sampling.build(rows),
    )


def pinned(obj):
    """A plan (or its nested dataclasses) with every CPU tensor in pinned
    memory, as the serving path hands plans over: the host-to-device copies
    of `plan.to(device)` are then truly asynchronous."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if obj.device.type == "cpu" else obj
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: pinned(getattr(obj, f.name)) for f in fields(obj) if f.init})
    return obj


def spin_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles that torch.cuda._sleep spins per millisecond."""
    cycles = 10_000_000
    return cycles / (_cuda_timed(lambda: torch.cuda._sleep(cycles), 3) * 1e3)


def cuda_step_times(engine: Engine, plan: BatchPlan, repeats: int, cycles_per_ms: float) -> tuple[float, float, float]:
    """(step, host launch, gpu) seconds of one decode step on CUDA."""
    device = engine.device
    engine.forward(plan)  # warm-up (a first replay, lazily built plans and workspaces)
    torch.cuda.synchronize(device)
    # Host: until launch returns, each launch from an idle device.
    host = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        engine.launch(plan)
        host += time.perf_counter() - start
        torch.cuda.synchronize(device)
    host /= repeats
    # Step: back-to-back launches, one sync at the end (overlapped serving's pace).
    start = time.perf_counter()
    for _ in range(repeats):
        engine.launch(plan)
    torch.cuda.synchronize(device)
    step = (time.perf_counter() - start) / repeats
    # GPU: a spin kernel keeps the device busy while the host enqueues, so the
    # events bracket the step's kernels alone, not the gaps between launches.
    gpu = 0.0
    shield = int(cycles_per_ms * (2 * host * 1e3 + 5))
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(shield)
        begin.record()
        engine.launch(plan)
        end.record()
        end.synchronize()
        gpu += begin.elapsed_time(end) / 1e3
    return step, host, gpu / repeats


def fill_kv(engine: Engine, plan: BatchPlan) -> None:
    """Write the pages the plan reads: never-written memory maps to the
    kernel's one zero page, which reads from cache and made attention look
    free (CPU); on a GPU it keeps uninitialized bits (NaN) out of the step."""
    buffer = getattr(engine.pool, "buffer", None)
    if isinstance(buffer, torch.Tensor) and buffer.dim() >= 3:
        used_slots = (int(plan.page_table.max()) + 1) * engine.page_size
        if buffer.dtype.itemsize > 1:
            buffer[:, :, :used_slots].uniform_(-1, 1)
            return
        for layer in buffer[:, :, :used_slots]:  # an FP8 cache (no uniform_ for float8): a layer at a time
            layer.copy_(torch.empty(layer.shape, device=layer.device).uniform_(-1, 1))


def measure(engine: Engine, batches: list[int], context: int, repeats: int) -> list[Row]:
    cfg = engine.model_config
    cuda = engine.device.type == "cuda"
    bandwidth = measured_bandwidth(engine.device)
    rate = measured_matmul_rate(engine.dtype, engine.device)
    what = "device copy (read + write)" if cuda else "memory read"
    logger.info("%s bandwidth %.1f GB/s, %s matmul %.1f GFLOP/s", what, bandwidth / 1e9, engine.dtype, rate / 1e9)
    cycles_per_ms = spin_cycles_per_ms(engine.device) if cuda else 0.0
    sampling = SamplingBatchBuilder(cfg.vocab_size, cfg.eos_token_ids, 0)
    results = []
    for batch in tqdm(batches, desc="batch sizes"):
        nbytes, flops = step_cost(engine, batch, context)
        plan = decode_plan(engine, batch, context, sampling)
        fill_kv(engine, plan)
        host_ms = gpu_ms = None
        if cuda:
            seconds, host, gpu = cuda_step_times(engine, pinned(plan), repeats, cycles_per_ms)
            host_ms, gpu_ms = host * 1e3, gpu * 1e3
        else:
            seconds = _timed(lambda: engine.forward(plan), repeats)
        memory_ms, compute_ms = nbytes / bandwidth * 1e3, flops / rate * 1e3
        results.append(Row(
            batch, context, nbytes, flops, memory_ms, compute_ms, max(memory_ms, compute_ms), seconds * 1e3,
            host_ms, gpu_ms,
        ))
    return results


def print_table(rows: list[Row]) -> None:
    cuda = any(r.gpu_ms is not None for r in rows)
    extra = f" {'host ms':>8} {'gpu ms':>8} {'host<gpu':>8}" if cuda else ""
    print(f"{'batch':>5} {'ctx':>5} {'MB/step':>9} {'GFLOP':>8} {'mem ms':>8} {'flop ms':>8} "
          f"{'bound ms':>9} {'step ms':>8} {'bound/step':>10} {'tok/s':>9} {'bound tok/s':>11}" + extra)
    for r in rows:
        extra = ""
        if r.host_launch_ms is not None and r.gpu_ms is not None:
            extra = f" {r.host_launch_ms:>8.2f} {r.gpu_ms:>8.2f} {str(r.host_launch_ms < r.gpu_ms).lower():>8}"
        print(f"{r.batch:>5} {r.context:>5} {r.bytes_per_step / 1e6:>9.1f} {r.flops_per_step / 1e9:>8.3f} "
              f"{r.memory_bound_ms:>8.2f} {r.compute_bound_ms:>8.2f} {r.bound_ms:>9.2f} {r.measured_ms:>8.2f} "
              f"{r.of_bound:>10.2f} {r.batch / r.measured_ms * 1e3:>9.0f} {r.batch / r.bound_ms * 1e3:>11.0f}" + extra)


def row_json(row: Row) -> dict:
    """The row's fields (CUDA-only ones left out where absent) and its ratio."""
    return {k: v for k, v in asdict(row).items() if v is not None} | {"of_bound": row.of_bound}


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r.batch for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r.batch / r.bound_ms * 1e3 for r in rows], "--", label="roofline bound")
    ax.plot(batches, [r.batch / r.measured_ms * 1e3 for r in rows], "o-", label="measured")
    ax.set(xscale="log", yscale="log", xlabel="decode batch", ylabel="output tok/s", title=f"context {rows[0].context}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--context", type=int, default=128, help="KV tokens of each request")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per batch size")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write a PNG here")
    add_options(p, EngineConfig)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = engine_config(args)
    pages_needed = max(args.batch) * -(-args.context // config.page_size) + 1
    config.num_pages = max(config.num_pages or 0, pages_needed)
    engine = Engine(config)
    if engine.device.type == "cuda":
        logger.info(
            "compute %s, KV %s on %s; attention %s, CUDA graphs %s", engine.dtype, engine.kv_dtype,
            torch.cuda.get_device_name(engine.device), getattr(engine, "attention_backend_name", "?"),
            getattr(getattr(engine, "graph_runner", None), "batch_sizes", None) or "off",
        )
    else:
        logger.info("compute %s, KV %s, %d threads", engine.dtype, engine.kv_dtype, torch.get_num_threads())
    rows = measure(engine, args.batch, args.context, args.repeats)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row_json(r) for r in rows], f, indent=2)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
