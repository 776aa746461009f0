"""Offline throughput of a random Qwen3-MoE against dense Qwen3 models of the
same attention: one whose MLP does the MoE's per-token work (intermediate =
top_k x expert size, "same active") and one with all the MoE's parameters
(intermediate = experts x expert size, "same total"). Each runs
benchmarks/offline.py (dummy weights) in its own process on one workload.

    python benchmarks/moe_vs_dense.py                  # CPU, float32, tiny
    python benchmarks/moe_vs_dense.py --hidden 2048 --layers 16 --experts 64 --top-k 8 \\
        --moe-intermediate 768 --dtype bfloat16 --device cuda --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dummy_model import moe_fields, write_dummy_model

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=str(HERE.parent.parent / "shared" / "models" / "stories260K"),
                   help="a folder with tokenizer files (a small vocabulary keeps the LM head out of the figure)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", default="32 128")
    p.add_argument("--output-len", default="32 64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    shared = dict(
        num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, max_position_embeddings=2048,
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True,
    )
    variants = {
        "moe": {**shared, "intermediate_size": args.moe_intermediate,
                **moe_fields(args.experts, args.top_k, args.moe_intermediate)},
        "dense, same active": {**shared, "intermediate_size": args.top_k * args.moe_intermediate},
        "dense, same total": {**shared, "intermediate_size": args.experts * args.moe_intermediate},
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in variants.items():
            folder = write_dummy_model(Path(args.tokenizer), Path(tmp) / name.replace(" ", "_").replace(",", ""), fields)
            out = Path(tmp) / "result.json"
            run = subprocess.run(
                [sys.executable, str(HERE / "offline.py"), "--model", str(folder), "--load-format", "dummy",
                 "--dtype", args.dtype, "--device", args.device, "--num-prompts", str(args.num_prompts),
                 "--input-len", *args.input_len.split(), "--output-len", *args.output_len.split(),
                 "--json", str(out)],
                capture_output=True, text=True,
            )
            if run.returncode:
                sys.exit(f"{name}: offline.py failed\n{run.stderr}")
            result = json.loads(out.read_text())
            rows.append((name, fields["intermediate_size"], result["output_tokens_per_s"], result["total_tokens_per_s"]))
    print(f"{'model':<20} {'mlp intermediate':>16} {'output tok/s':>12} {'total tok/s':>12}")
    for name, intermediate, out_tps, total_tps in rows:
        print(f"{name:<20} {intermediate:>16} {out_tps:>12} {total_tps:>12}")


if __name__ == "__main__":
    main()
