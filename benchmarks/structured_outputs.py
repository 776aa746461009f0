"""Throughput of constrained decoding against free decoding, offline API.

    python benchmarks/structured_outputs.py --model /tmp/tinyllama-dummy --load-format dummy

Runs N concurrent requests of max_tokens each, four ways: all free, all
json_schema (a free-text string field: the costliest grammar state to mask),
all json_schema of a structured record, and half free / half constrained.
Prints generated tokens per second and steps (the fastest of --repeats). Under overlap a constrained
request is planned only when its previous token has landed, so it decodes
every other step when batched with free requests.
"""

from __future__ import annotations

import argparse
import time

from aioserve import LLM, SamplingParams
from aioserve.sampling_params import StructuredOutputParams

FREE_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "owner": {"type": "object", "properties": {"vip": {"type": "boolean"}, "score": {"type": "number"}}},
    },
    "required": ["id", "name", "tags", "owner"],
}


def run(llm: LLM, params: list[SamplingParams]) -> tuple[float, int, int]:
    steps = llm.stats.steps
    start = time.perf_counter()
    outputs = llm.generate(["Write a JSON record about a cat:"] * len(params), params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outputs), llm.stats.steps - steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="each run this often; the fastest counts")
    args = p.parse_args()
    llm = LLM(args.model, load_format=args.load_format, device=args.device, overlap=not args.no_overlap)
    n, m = args.requests, args.max_tokens

    def free(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=m, temperature=1.0, seed=i, ignore_eos=True)

    def json_params(i: int, schema: dict) -> SamplingParams:
        return SamplingParams(max_tokens=m, temperature=1.0, seed=i, structured_outputs=StructuredOutputParams(json=schema))

    runs = {
        "free": [free(i) for i in range(n)],
        "json_schema (free-text string)": [json_params(i, FREE_TEXT) for i in range(n)],
        "json_schema (record)": [json_params(i, RECORD) for i in range(n)],
        "half free, half json_schema": [free(i) if i % 2 else json_params(i, FREE_TEXT) for i in range(n)],
    }
    run(llm, [json_params(0, FREE_TEXT), json_params(0, RECORD), free(0)])  # warm up: vocabulary, grammars, kernels
    print(f"{n} concurrent requests, max_tokens {m}, overlap {'off' if args.no_overlap else 'on'}, device {llm.engine.device}")
    for name, params in runs.items():
        elapsed, tokens, steps = min(run(llm, params) for _ in range(args.repeats))
        print(f"  {name:32s} {tokens / elapsed:8.1f} tok/s  {tokens:5d} tokens  {steps:4d} steps  {elapsed:6.2f} s")
    llm.close()


if __name__ == "__main__":
    main()
