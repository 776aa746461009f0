"""Write a model folder for --load-format dummy: a tokenizer folder's files
plus a config.json with the dimensions you ask for (no weights).

    python benchmarks/dummy_model.py --tokenizer ../shared/tokenizers/qwen3 --out /tmp/qwen3-mini \\
        --layers 8 --hidden 512 --intermediate 1536 --heads 8 --kv-heads 4 --head-dim 64
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


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
    args = p.parse_args()
    source, out = Path(args.tokenizer), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name != "config.json" and file.is_file():
            shutil.copy(file, out / file.name)
    config = json.loads((source / "config.json").read_text()) if (source / "config.json").exists() else {}
    config.update(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim or args.hidden // args.heads,
        max_position_embeddings=args.max_position,
    )
    config.setdefault("architectures", ["LlamaForCausalLM"])
    config.setdefault("vocab_size", 32000)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(out)


if __name__ == "__main__":
    main()
