"""Pack the model folders a GPU session needs into `.gpu_models/` at the
repository root (run on the CPU machine, before the session).

The GPU machine gets only the repository's working tree (64 MiB in all);
`../shared` does not travel. The benchmarks there use dummy weights, so a
model is its config.json plus its tokenizer files, with tokenizer.json
gzipped (about a fifth of its size; `benchmarks/gpu_check.sh` unpacks
it); a variant (a base's files with config.json changed) names its base's
tokenizer instead of carrying a copy. stories260K needs no copy: the tests find it in the package
(aioserve/demo_model, tests/conftest.py's STORIES).

    python tools/gpu/prepare_models.py            # then: du -sh .gpu_models

`.gpu_models/` is not tracked (an ignore line keeps it out of git) but
travels to the GPU machine with the working tree when listed in `carry`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("AIOSERVE_SHARED", REPO.parent / "shared"))
# name in .gpu_models -> folder under shared/tokenizers
MODELS = {
    "qwen3": "qwen3",  # Qwen3-0.6B's config
    "llama3-8b-instruct": "llama3-8b-instruct",  # Llama-3-8B's config
}
# Shapes of issue 30's families for the GPU figures: a packed model's files
# with config.json changed. name -> (packed model it starts from, config changes).
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
QWEN3_MOE_LAYER = {  # Qwen3-30B-A3B's layer: 128 experts of 768, top-8, 32 q / 4 kv heads of 128
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": 6144, "tie_word_embeddings": False,
}
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3-fp8": ("qwen3", {"quantization_config": FP8_BLOCKS}),  # Qwen3-0.6B, 128 x 128 FP8 blocks
    "llama3-8b-fp8": ("llama3-8b-instruct", {"quantization_config": FP8_BLOCKS}),
    "qwen3-moe-tiny": ("qwen3", {**QWEN3_MOE_LAYER, "hidden_size": 1024, "num_attention_heads": 16,
                                 "num_key_value_heads": 8, "num_experts": 8, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 512, "num_hidden_layers": 8}),
    # head_dim 64 (the GPU tests' second FlashInfer head size, and the FP8 KV
    # cache's): two layers, only for the JIT warm-up of `gpu_check.sh proof`.
    "qwen3-hd64": ("qwen3", {"head_dim": 64, "num_hidden_layers": 2}),
    # 12 of Qwen3-30B-A3B's 48 layers: 8.1B parameters, 1.0B active.
    "qwen3-moe-8b": ("qwen3", {**QWEN3_MOE_LAYER, "num_hidden_layers": 12}),
}
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")


# A variant's tokenizer.json is its base's: the folder names the base in this
# file instead of carrying a second 2 MiB copy (gpu_check.sh's unpack_models copies it).
TOKENIZER_FROM = "tokenizer.json.from"


def pack_model(source: Path, target: Path, tokenizer_from: str | None = None) -> int:
    """Copy `source`'s config and tokenizer files into `target`, tokenizer.json
    gzipped (or, with `tokenizer_from`, named as that packed folder's);
    returns the bytes written."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in SMALL_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    if tokenizer_from is not None:
        (target / TOKENIZER_FROM).write_text(tokenizer_from + "\n")
    else:
        with (source / "tokenizer.json").open("rb") as raw, gzip.open(target / "tokenizer.json.gz", "wb", 9) as packed:
            shutil.copyfileobj(raw, packed)
    return sum(f.stat().st_size for f in target.iterdir())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / ".gpu_models")
    p.add_argument(
        "--shared", type=Path, default=SHARED, help="the shared/ folder (default: $AIOSERVE_SHARED or ../shared)"
    )
    args = p.parse_args()
    total = 0
    for name, folder in MODELS.items():
        size = pack_model(args.shared / "tokenizers" / folder, args.out / name)
        total += size
        print(f"{args.out / name}: {size / 2**20:.2f} MiB")
    for name, (base, changes) in VARIANTS.items():
        size = pack_model(args.shared / "tokenizers" / MODELS[base], args.out / name, tokenizer_from=base)
        config = json.loads((args.out / name / "config.json").read_text())
        (args.out / name / "config.json").write_text(json.dumps({**config, **changes}, indent=2))
        total += size
        print(f"{args.out / name}: {size / 2**20:.2f} MiB ({base}, config changed)")
    print(f"total {total / 2**20:.2f} MiB in {args.out}")


if __name__ == "__main__":
    main()
