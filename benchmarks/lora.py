"""Multi-LoRA throughput: 64 requests over 1, 4 and 16 adapters beside the base model alone.

Each model shape (tiny-llama: stories15M's shape with Llama's vocabulary, in
float32; Qwen3-0.6B in bfloat16; dummy weights, real tokenizers from
../shared/tokenizers) serves the same 64 prompts at concurrency 16
(`max_running_requests`) through the Python API: once with no adapter, then
spread round-robin over 1, 4 and 16 rank-16 adapters on q/k/v/o/gate/up/down
(random A and B, written as PEFT folders), with as many slots as adapters.
Output tokens per second, and each as a fraction of the base model's.

    python benchmarks/lora.py                                   # both shapes
    python benchmarks/lora.py --models tiny-llama --tokens 32 --png lora.png
    python benchmarks/lora.py --models tiny-llama --lora-dtype bfloat16   # float32 model, bf16 adapters
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' PEFT-layout writer

from cpu_limits import MODELS, ModelSpec  # noqa: E402
from dummy_model import write_dummy_model  # noqa: E402
from lora_adapters import write_raw_adapter  # noqa: E402

from aioserve import LLM, SamplingParams  # noqa: E402
from aioserve.config import LORA_DTYPES  # noqa: E402

logger = logging.getLogger("benchmarks.lora")


@dataclass
class Row:
    model: str
    adapters: int  # 0: the base model alone
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def model_folder(name: str, spec: ModelSpec, root: Path) -> Path:
    return write_dummy_model(spec.folder, root / name, spec.fields) if spec.dummy else spec.folder


def run(name: str, spec: ModelSpec, root: Path, counts: list[int], args: argparse.Namespace) -> list[Row]:
    folder = model_folder(name, spec, root)
    config = json.loads((folder / "config.json").read_text())
    most = max(counts)
    adapters = [write_raw_adapter(folder, root / f"{name}-adapter-{i}", args.rank, seed=i, scale=0.1)
                for i in range(most)]
    llm = LLM(str(folder), load_format="dummy" if spec.dummy else "auto", dtype=spec.dtype, enable_lora=True,
              max_loras=most, max_lora_rank=args.rank, max_running_requests=args.concurrency,
              cuda_graph=not args.enforce_eager, lora_dtype=args.lora_dtype,
              lora_modules=[f"a{i}={path}" for i, path in enumerate(adapters)])
    generator = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]
    prompts = [torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rows = []
    try:
        llm.generate(prompts[: args.concurrency], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        # Rounds of every setting in turn (base, 1, 4, 16, base, 1, ...), each
        # setting's median kept: tiny-llama's base moved 809 -> 1145 tok/s
        # between two single runs on an idle box, which a ratio cannot absorb.
        # The first round also loads each adapter (reading, packing).
        times: dict[int, list[float]] = {}
        produced: dict[int, int] = {}
        for _ in tqdm(range(args.repeats), desc=name, unit="round"):
            for count in [0, *counts]:
                choices = [None if count == 0 else f"a{i % count}" for i in range(args.requests)]
                llm.scheduler.flush_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, lora_request=choices)
                times.setdefault(count, []).append(time.perf_counter() - start)
                produced[count] = sum(len(o.token_ids) for o in outputs)
        for count in [0, *counts]:
            rows.append(Row(name, count, statistics.median(times[count]), produced[count]))
    finally:
        llm.close()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| model | adapters | out tok/s | vs base |", "|---|---|---|---|"]
    base = {row.model: row.tokens_per_s for row in rows if row.adapters == 0}
    for row in rows:
        label = "base model" if row.adapters == 0 else str(row.adapters)
        lines.append(f"| {row.model} | {label} | {row.tokens_per_s:.1f} | {row.tokens_per_s / base[row.model]:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for model in dict.fromkeys(row.model for row in rows):
        mine = [row for row in rows if row.model == model]
        base = mine[0].tokens_per_s
        ax.plot([str(r.adapters or "base") for r in mine], [r.tokens_per_s / base for r in mine], marker="o",
                label=model)
    ax.set_xlabel("adapters in the mix")
    ax.set_ylabel("output tok/s vs the base model")
    ax.axhline(0.75, linestyle=":", color="grey")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "qwen3-0.6b"], choices=list(MODELS))
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the settings; each one's median is kept")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the base model through the modules too (no CUDA graph, no native decode step)")
    parser.add_argument("--lora-dtype", default="auto", choices=LORA_DTYPES,
                        help="the adapters' dtype (bfloat16: half a float32 model's adapter bytes)")
    parser.add_argument("--png", help="write a plot here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows += run(name, MODELS[name], Path(tmp), args.adapters, args)
    print(table(rows))
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
