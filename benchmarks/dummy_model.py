"""Write a model folder for --load-format dummy: a tokenizer folder's files
plus a config.json with the dimensions you ask for (no weights).

    python benchmarks/dummy_model.py --tokenizer ../shared/tokenizers/qwen3 --out /tmp/qwen3-mini \\
        --layers 8 --hidden 512 --intermediate 1536 --heads 8 --kv-heads 4 --head-dim 64
    # a Qwen3-MoE of the same attention, 8 experts of 192, top 2
    python benchmarks/dummy_model.py --tokenizer ../shared/tokenizers/qwen3 --out /tmp/qwen3-moe-mini \\
        --layers 8 --hidden 512 --intermediate 1536 --heads 8 --kv-heads 4 --head-dim 64 \\
        --experts 8 --top-k 2 --moe-intermediate 192
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any


def write_dummy_model(tokenizer: Path, out: Path, fields: dict[str, Any]) -> Path:
    """`tokenizer`'s files (its config.json aside) into `out`, and a config.json
    that is the tokenizer folder's (if any) updated with `fields`."""
    out.mkdir(parents=True, exist_ok=True)
    for file in tokenizer.iterdir():
        if file.name != "config.json" and file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, out / file.name)
    config = json.loads((tokenizer / "config.json").read_text()) if (tokenizer / "config.json").exists() else {}
    config.update(fields)
    config.setdefault("architectures", ["LlamaForCausalLM"])
    config.setdefault("vocab_size", 32000)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def moe_fields(experts: int, top_k: int, moe_intermediate: int) -> dict[str, Any]:
    """A Qwen3-MoE's config fields: every layer sparse, top-k renormalised."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": moe_intermediate, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a folder with tokenizer files (and maybe config.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--max-position", type=int, default=8192)
    p.add_argument("--experts", type=int, help="a Qwen3-MoE with this many experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (with --experts)")
    p.add_argument("--moe-intermediate", type=int, help="each expert's intermediate size (with --experts)")
    args = p.parse_args()
    fields: dict[str, Any] = dict(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim or args.hidden // args.heads,
        max_position_embeddings=args.max_position,
    )
    if args.experts:
        fields.update(moe_fields(args.experts, args.top_k, args.moe_intermediate or args.intermediate))
    print(write_dummy_model(Path(args.tokenizer), Path(args.out), fields))


if __name__ == "__main__":
    main()
