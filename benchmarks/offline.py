"""Offline throughput of LLM.generate: N prompts of random token ids with
random input/output lengths, all submitted at once.

    python benchmarks/offline.py --model ../shared/models/stories260K
    python benchmarks/offline.py --model ../shared/tokenizers/qwen3 --load-format dummy --dtype bfloat16
    # issue 11's GPU workload (mini-sglang's setup); add --disable-cuda-graph or --disable-overlap to compare
    python benchmarks/offline.py --model .gpu_models/qwen3 --load-format dummy --dtype bfloat16 \\
        --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --seed 0 --json offline.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import asdict

import torch

from aioserve import LLM, SamplingParams
from aioserve.cli import add_options, engine_config
from aioserve.config import EngineConfig

logger = logging.getLogger("benchmarks.offline")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 512], metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 256], metavar=("LO", "HI"))
    p.add_argument("--json", help="write the results here")
    add_options(p, EngineConfig)  # every engine option of `aioserve serve`; --seed also seeds the prompts
    # This script's older spelling of --disable-overlap.
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help=argparse.SUPPRESS)
    return p.parse_args()


def engine_facts(llm: LLM) -> dict[str, object]:
    """What ran: device, attention backend, CUDA graphs, overlap (the lines of
    a comparison table)."""
    engine = llm.engine
    runner = getattr(engine, "graph_runner", None)
    return {
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "attention_backend": getattr(engine, "attention_backend_name", llm.config.attention_backend),
        # (on the CPU the runner is the native decode stack, which has no batch sizes)
        "cuda_graph_batch_sizes": len(getattr(runner, "batch_sizes", ())),
        "overlap": llm.config.overlap,
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    llm = LLM(**asdict(engine_config(args)))
    rng = random.Random(args.seed)
    # Ids from the middle of the vocabulary: real tokens, never special ones.
    low, high = min(1000, llm.engine.vocab_size // 4), llm.engine.vocab_size // 2
    prompts, params = [], []
    for _ in range(args.num_prompts):
        prompts.append([rng.randrange(low, high) for _ in range(rng.randint(*args.input_len))])
        params.append(SamplingParams(max_tokens=rng.randint(*args.output_len), temperature=0, ignore_eos=True))
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    results = {
        "model": args.model,
        **engine_facts(llm),
        "dtypes": "weights {}, compute {}, KV {}".format(
            *(str(d).removeprefix("torch.") for d in (llm.engine.weight_dtype, llm.engine.dtype, llm.engine.kv_dtype))
        ),
        "num_prompts": args.num_prompts,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(args.num_prompts / elapsed, 3),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "total_tokens_per_s": round((input_tokens + output_tokens) / elapsed, 1),
        "steps": llm.stats.steps,
        # Decode steps replayed from a graph (the warm-up's included): the rest ran eagerly, mostly mixed steps.
        "graph_replays": llm.engine.graph_runner.replays if llm.engine.graph_runner is not None else 0,
        "preemptions": llm.stats.preemptions,
    }
    width = max(len(k) for k in results)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in results.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
