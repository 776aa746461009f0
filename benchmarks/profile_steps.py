"""Where a step's time goes: LLM.generate under torch.profiler, the top ops
by self time (CPU and, on a GPU, CUDA), and the mean wall time per step.

    python benchmarks/profile_steps.py --model ../shared/tokenizers/qwen3 --load-format dummy --dtype bfloat16 \\
        --num-prompts 1 --input-len 64 --output-len 64
    --sync-debug (CUDA) warns at every op that makes the host wait for the device.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from aioserve import LLM, SamplingParams
from aioserve.batch_plan import BatchPlan, StepOutput
from aioserve.engine.engine import Engine


class InlineExecutor:
    """Runs each step on the loop's own thread, waiting for it: the profiler
    records only the threads it was started on, and this puts the forward
    there. (Timings under it include no overlap.)"""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def submit(self, plan: BatchPlan) -> "asyncio.Future[StepOutput]":
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.engine.forward(plan))
        return future

    def shutdown(self) -> None:
        pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--sync-debug", action="store_true")
    p.add_argument("--trace", help="write a Chrome trace here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(args.model, dtype=args.dtype, load_format=args.load_format, overlap=not args.no_overlap)
    rng = random.Random(0)
    low, high = min(1000, llm.engine.vocab_size // 4), llm.engine.vocab_size // 2
    prompts = [[rng.randrange(low, high) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: allocator, kernels, lazy inits
    cuda = llm.engine.device.type == "cuda"
    steps_before, start = llm.scheduler.stats.steps, time.perf_counter()
    llm.generate(prompts, params)
    plain = (time.perf_counter() - start) * 1000 / max(llm.scheduler.stats.steps - steps_before, 1)
    if cuda and args.sync_debug:
        torch.cuda.set_sync_debug_mode("warn")
    real_executor, llm.scheduler.executor = llm.scheduler.executor, InlineExecutor(llm.engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps_before = llm.scheduler.stats.steps
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    steps = llm.scheduler.stats.steps - steps_before
    llm.scheduler.executor = real_executor
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if cuda:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    print(f"{plain:.2f} ms per step; {steps} steps in {elapsed:.3f} s with the profiler on")
    llm.close()


if __name__ == "__main__":
    main()
