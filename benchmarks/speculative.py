"""Speculative decoding: acceptance length and output tok/s, with and without.

For each concurrency (requests submitted together through the Python API),
the same prompts run plainly and with each proposer, alternated repeat by
repeat: prompt lookup (ngram) on prompts that quote themselves (a story
retold, a list repeated), and an "oracle" that proposes the plain run's own
tokens (the ceiling: every proposal stands, what a draft equal to the
target would give) and one that proposes wrong tokens (the floor: the cost
of verifying k + 1 positions for one token). Plain decoding is timed twice
on one engine: as served (overlap: the next step planned while one runs)
and stepping as a speculating engine does (no overlap: a proposal is made
from the newest token), so that the proposers' gain is not confused with
overlap's (on 2 cores overlap can cost more than it hides). With
--draft-models, the draft_model method too: the target as its own draft
(the ceiling with a draft's cost: every proposal stands, and the draft runs
the whole model k + 1 times a step), a one-layer random-weight draft of the
target's vocabulary (the floor: a cheap draft that is almost always wrong),
and a random EAGLE-3 head (the eagle3 method's floor: its cost, nothing
gained). Greedy outputs are checked equal to the plain run's on every repeat
in float32. In half precision they are compared, not required equal: the
verification scores k + 1 positions with the prefill kernel and plain
decoding one with the decode kernel, which round differently, and random
weights leave near-ties that a rounding flips; the "agree" column gives the
share of each output that matches plain's up to its first difference.

    python benchmarks/speculative.py                         # demo model, concurrency 1 4 16
    python benchmarks/speculative.py --tokens 64 --k 4 --png spec.png
    python benchmarks/speculative.py --draft-models          # and the draft_model method
    python benchmarks/speculative.py --model .gpu_models/qwen3 --load-format dummy --dtype bfloat16 \
        --concurrency 1 --draft-models --json spec.json       # a GPU's figure (gpu_check.sh figures)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' EAGLE-3 head writer
from tiny_models import build_eagle3_head  # noqa: E402

from aioserve import LLM, SamplingParams  # noqa: E402
from aioserve.models.source import resolve_model_path  # noqa: E402
from aioserve.scheduler.request import Request  # noqa: E402
from aioserve.scheduler.speculation import SpeculationStats  # noqa: E402
from aioserve.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE, DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN  # noqa: E402

logger = logging.getLogger("benchmarks.speculative")

PROMPT_TOKENS = 512  # the longest prompt the pools are sized for (pages_for_run)

# Prompts that quote themselves: what prompt lookup is for.
QUOTING = [
    "Once upon a time there was a little girl named Lily. She loved to play outside. "
    "Once upon a time there was a little girl named Lily. She loved to",
    "One day, Tom went to the park with his mom. They saw a big dog. One day, Tom went to the park with his",
    "apples, pears, plums, apples, pears, plums, apples, pears, plums, apples,",
    "The sun was hot. The sun was hot. The sun was hot. The sun was",
]


PLAIN_SERIAL = "plain, no overlap"


class Oracle:
    """Proposes the plain run's tokens (right) or a shifted copy of them (wrong)."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], right: bool) -> None:
        self.expected, self.right = expected, right

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        done = request.num_output_tokens
        draft = self.expected[tuple(request.prompt_ids)][done : done + num_tokens]
        return draft if self.right else [(t + 1) % 256 for t in draft]


@dataclass
class Row:
    method: str
    concurrency: int
    seconds: list[float] = field(default_factory=list)
    output_tokens: int = 0
    acceptance: float = 0.0  # mean tokens a verification gives (1 = plain)
    agreement: float = 1.0  # share of output equal to plain's before the first difference (lowest repeat)
    overlapped: float | None = None  # share of steps planned before the last one landed (last repeat); None: overlap off

    @property
    def tok_s(self) -> float:
        return self.output_tokens / statistics.median(self.seconds)


def random_draft(target: str, folder: Path) -> Path:
    """A one-layer Llama of random weights with the target's vocabulary and
    tokenizer files: a draft as cheap as drafts get, and nearly always wrong."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = resolve_model_path(target)
    config = json.loads((source / "config.json").read_text())
    torch.manual_seed(0)
    draft = LlamaForCausalLM(LlamaConfig(
        vocab_size=config["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=False,
    ))
    draft.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        if (source / name).exists():
            (folder / name).write_bytes((source / name).read_bytes())
    return folder


def engine_options(args: argparse.Namespace) -> dict:
    """What every engine of the run is given (a GPU run: dummy bf16 weights)."""
    options: dict = {"num_threads": args.threads, "load_format": args.load_format, "dtype": args.dtype,
                     "device": args.device}
    if args.cuda_graph_max_bs is not None:
        options["cuda_graph_max_bs"] = args.cuda_graph_max_bs
    # Up to five engines live at once, each with its own pool: each gets the
    # pages this run can use, not a memory share (on a GPU) or the CPU's
    # default budget (4 GiB each, and Qwen3-0.6B with --draft-models was
    # killed for memory on a 24 GiB machine).
    options["num_pages"] = args.num_pages if args.num_pages is not None else pages_for_run(args)
    return options


def pages_for_run(args: argparse.Namespace, page_size: int = 16) -> int:
    """KV pages that the run's largest batch can hold: each request's prompt
    (QUOTING's, at most PROMPT_TOKENS), its output and a verification's k + 1
    rows, a page to spare each."""
    per_request = -(-(PROMPT_TOKENS + args.tokens + args.k + 1) // page_size) + 1
    return max(args.concurrency) * per_request + 8


# --draft-models' choices: (row name, method) each.
DRAFTS = {"target": ("draft = target", "draft_model"), "random": ("draft 1-layer random", "draft_model"),
          "eagle3": ("eagle3 random head", "eagle3")}


def draft_path(choice: str, model: str, folder: Path) -> str:
    """The checkpoint of a --draft-models choice, written into `folder` where it is made here."""
    target = resolve_model_path(model)
    if choice == "target":
        return str(target)
    if choice == "random":
        return str(random_draft(model, folder / "draft"))
    return str(build_eagle3_head(folder / "eagle3", target, seed=0))


def draft_engines(args: argparse.Namespace, folder: Path) -> dict[str, LLM]:
    """The draft_model and eagle3 methods' engines, by row name: none without
    --draft-models, all three with it alone, else the ones it names."""
    if args.draft_models is None:
        return {}
    engines = {}
    for choice in args.draft_models or list(DRAFTS):
        name, method = DRAFTS[choice]
        engines[name] = LLM(args.model, **engine_options(args), speculative_config={
            "method": method, "model": draft_path(choice, args.model, folder), "num_speculative_tokens": args.k,
            "disable_by_batch_size": args.disable_by_batch_size})
    return engines


def agreement(outs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each output that equals the reference up to its first difference."""
    shares = []
    for out, ref in zip(outs, reference):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        shares.append(same / max(len(ref), 1))
    return sum(shares) / max(len(shares), 1)


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def timed_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, row: Row) -> list[list[int]]:
    """One run into `row`: its seconds, and the share of its steps that kept
    overlap (a speculating step waits for the one before it to land)."""
    stats = llm.scheduler.stats
    steps, waits = stats.steps, stats.token_waits
    seconds, outs = run_once(llm, prompts, params)
    row.seconds.append(seconds)
    ran = stats.steps - steps
    row.overlapped = 1 - (stats.token_waits - waits) / ran if llm.scheduler.config.overlap and ran else None
    return outs


def measure(args: argparse.Namespace) -> list[Row]:
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min, "disable_by_batch_size": args.disable_by_batch_size}
    plain = LLM(args.model, **engine_options(args))
    fast = LLM(args.model, **engine_options(args), speculative_config=spec)
    folder = tempfile.TemporaryDirectory(prefix="aioserve-draft-")
    drafted = draft_engines(args, Path(folder.name))
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rows: list[Row] = []
    ngram = fast.scheduler.speculator.proposer
    exact = plain.engine.dtype == torch.float32  # half precision: compared, not required equal (docstring)
    try:
        for concurrency in args.concurrency:
            texts = [QUOTING[i % len(QUOTING)] for i in range(concurrency)]
            prompts = [plain.encode(t) for t in texts]
            if max(map(len, prompts)) > PROMPT_TOKENS:
                raise SystemExit(f"a prompt is over the {PROMPT_TOKENS} tokens the KV pools are sized for")
            _, reference = run_once(plain, prompts, params)  # warm-up, and the outputs to match
            expected = {tuple(p): out for p, out in zip(prompts, reference)}
            proposers = {"ngram": ngram, "oracle (ceiling)": Oracle(expected, True),
                         "wrong (floor)": Oracle(expected, False)}
            # (row name, engine, the proposer it takes: None for a draft model's, made in the engine)
            runs = [(name, fast, proposer) for name, proposer in proposers.items()]
            runs += [(name, llm, None) for name, llm in drafted.items()]
            by_method = {name: Row(name, concurrency) for name in ["plain", PLAIN_SERIAL, *proposers, *drafted]}
            for _ in tqdm(range(args.repeats), desc=f"concurrency {concurrency}"):
                timed_run(plain, prompts, params, by_method["plain"])
                # The same engine stepping as a speculating one does (each
                # step lands before the next is planned): what the proposers'
                # rows gain or lose against, overlap apart.
                plain.scheduler.config.overlap = False
                try:
                    timed_run(plain, prompts, params, by_method[PLAIN_SERIAL])
                finally:
                    plain.scheduler.config.overlap = True
                for name, llm, proposer in runs:
                    if proposer is not None:
                        llm.scheduler.speculator.proposer = proposer
                    llm.scheduler.speculator.stats = stats = SpeculationStats()
                    outs = timed_run(llm, prompts, params, by_method[name])
                    if outs != reference and exact:
                        raise AssertionError(f"{name} at concurrency {concurrency}: outputs differ from plain decoding")
                    by_method[name].agreement = min(by_method[name].agreement, agreement(outs, reference))
                    by_method[name].acceptance = stats.mean_acceptance_length
            for row in by_method.values():
                row.output_tokens = concurrency * args.tokens
            rows += by_method.values()
    finally:
        for llm in (plain, fast, *drafted.values()):
            llm.close()
        folder.cleanup()
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'method':<21} {'conc':>4} {'tok/s':>8} {'vs plain':>8} {'accept len':>10} {'agree':>6} {'overlapped':>10}")
    plain = {r.concurrency: r.tok_s for r in rows if r.method == "plain"}
    for r in rows:
        accept = f"{r.acceptance:.2f}" if r.method not in ("plain", PLAIN_SERIAL) else "-"
        overlapped = f"{r.overlapped:.2f}" if r.overlapped is not None else "-"
        print(f"{r.method:<21} {r.concurrency:>4} {r.tok_s:>8.1f} {r.tok_s / plain[r.concurrency]:>7.2f}x {accept:>10} "
              f"{r.agreement:>6.2f} {overlapped:>10}")


def write_plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        ax.plot([r.concurrency for r in mine], [r.tok_s for r in mine], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_title("speculative decoding (greedy, outputs equal to plain)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per verification")
    parser.add_argument("--disable-by-batch-size", type=int, default=DEFAULT_DISABLE_BY_BATCH_SIZE)
    parser.add_argument("--lookup-max", type=int, default=DEFAULT_LOOKUP_MAX)
    parser.add_argument("--lookup-min", type=int, default=DEFAULT_LOOKUP_MIN)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--draft-models", nargs="*", choices=DRAFTS, default=None,
                        help="also the draft_model method (the target as its own draft, a 1-layer random draft) and the "
                        "eagle3 method (a random head); naming some runs only those (an 8B shape: `target`)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                        help="dummy: random weights of the config's shapes (a GPU run carries no weights)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None, help="fewer graphs to capture per engine")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="each engine's KV pool in pages (on a GPU the engines share: a memory share would go "
                        "to the first)")
    parser.add_argument("--png", help="also write a plot here")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = measure(args)
    print_table(rows)
    if args.png:
        write_plot(rows, args.png)
    if args.json:
        plain = {r.concurrency: r.tok_s for r in rows if r.method == "plain"}
        Path(args.json).write_text(json.dumps([
            {"model": args.model, "method": r.method, "concurrency": r.concurrency, "tok_s": r.tok_s,
             "vs_plain": r.tok_s / plain[r.concurrency], "acceptance": r.acceptance,
             "agreement": r.agreement, "overlapped": r.overlapped} for r in rows
        ], indent=1))


if __name__ == "__main__":
    main()
