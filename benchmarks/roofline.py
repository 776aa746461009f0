"""How close a decode step comes to this machine's limits.

For a model, batch sizes and a context length it prints, per batch size:
the bytes a decode step must read (weights once, plus every request's KV)
over the *measured* memory bandwidth, the FLOPs it must do over the
*measured* matmul rate, the larger of the two (the roofline bound), and the
measured step (Engine.forward on a decode-only plan, sampling included) and
its ratio to the bound. Nothing is assumed about the machine: both rates are
measured here, with the engine's thread count and compute dtype.

    python benchmarks/roofline.py --model ../shared/models/stories260K --batch 1 16 64 --context 128
    python benchmarks/roofline.py --model ../shared/tokenizers/qwen3 --load-format dummy --batch 1 64 --plot roof.png
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from aioserve.batch_plan import BatchPlan
from aioserve.cli import add_options, engine_config
from aioserve.config import EngineConfig
from aioserve.engine.engine import Engine
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

    @property
    def of_bound(self) -> float:
        return self.bound_ms / self.measured_ms


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measured_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second that a full read of a large buffer reaches (a sum:
    reads only, as a decode step's weight and KV traffic is)."""
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    seconds = _timed(lambda: buffer.sum(), 5)
    return buffer.numel() * 4 / seconds


def measured_matmul_rate(dtype: torch.dtype, size: int = 1024) -> float:
    """Peak FLOP/s of a matmul in `dtype` at a shape large enough that
    overheads vanish: the compute roof (thin decode shapes sit under it)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _timed(lambda: a @ b, 10)


def step_cost(engine: Engine, batch: int, context: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `batch` requests at `context`."""
    cfg = engine.model_config
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    matmul_params = sum(p.numel() for p in engine.model.parameters() if p.dim() >= 2)  # packed: 3-D
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if not tied:  # the input embedding is a lookup, not a matmul
        matmul_params -= cfg.vocab_size * cfg.hidden_size
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


def measure(engine: Engine, batches: list[int], context: int, repeats: int) -> list[Row]:
    cfg = engine.model_config
    bandwidth = measured_bandwidth()
    rate = measured_matmul_rate(engine.dtype)
    logger.info("memory read bandwidth %.1f GB/s, %s matmul %.1f GFLOP/s", bandwidth / 1e9, engine.dtype, rate / 1e9)
    sampling = SamplingBatchBuilder(cfg.vocab_size, cfg.eos_token_ids, 0)
    results = []
    for batch in tqdm(batches, desc="batch sizes"):
        nbytes, flops = step_cost(engine, batch, context)
        plan = decode_plan(engine, batch, context, sampling)
        # Write the pages it reads: never-written memory maps to the kernel's
        # one zero page, which reads from cache and made attention look free.
        used_slots = (int(plan.page_table.max()) + 1) * engine.page_size
        engine.pool.buffer[:, :, :used_slots].uniform_(-1, 1)
        seconds = _timed(lambda: engine.forward(plan), repeats)
        memory_ms, compute_ms = nbytes / bandwidth * 1e3, flops / rate * 1e3
        results.append(
            Row(batch, context, nbytes, flops, memory_ms, compute_ms, max(memory_ms, compute_ms), seconds * 1e3)
        )
    return results


def print_table(rows: list[Row]) -> None:
    print(f"{'batch':>5} {'ctx':>5} {'MB/step':>9} {'GFLOP':>8} {'mem ms':>8} {'flop ms':>8} "
          f"{'bound ms':>9} {'step ms':>8} {'bound/step':>10} {'tok/s':>9} {'bound tok/s':>11}")
    for r in rows:
        print(f"{r.batch:>5} {r.context:>5} {r.bytes_per_step / 1e6:>9.1f} {r.flops_per_step / 1e9:>8.3f} "
              f"{r.memory_bound_ms:>8.2f} {r.compute_bound_ms:>8.2f} {r.bound_ms:>9.2f} {r.measured_ms:>8.2f} "
              f"{r.of_bound:>10.2f} {r.batch / r.measured_ms * 1e3:>9.0f} {r.batch / r.bound_ms * 1e3:>11.0f}")


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
    logger.info("compute %s, KV %s, %d threads", engine.dtype, engine.kv_dtype, torch.get_num_threads())
    rows = measure(engine, args.batch, args.context, args.repeats)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"of_bound": r.of_bound} for r in rows], f, indent=2)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
