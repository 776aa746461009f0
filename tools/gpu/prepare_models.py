"""Pack the model folders a GPU session needs into `.gpu_models/` at the
repository root (run on the CPU machine, before the session).

The GPU machine gets only the repository's working tree (64 MiB in all);
`../shared` does not travel. The benchmarks there use dummy weights, so a
model is its config.json plus its tokenizer files, with tokenizer.json
gzipped (about a fifth of its size; `benchmarks/gpu_check.sh setup` unpacks
it). stories260K needs no copy: the tests find it in the package
(aioserve/demo_model, tests/conftest.py's STORIES).

    python tools/gpu/prepare_models.py            # then: du -sh .gpu_models

`.gpu_models/` is not tracked (an ignore line keeps it out of git) but
travels to the GPU machine with the working tree when listed in `carry`.
"""

from __future__ import annotations

import argparse
import gzip
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
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")


def pack_model(source: Path, target: Path) -> int:
    """Copy `source`'s config and tokenizer files into `target`, tokenizer.json
    gzipped; returns the bytes written."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in SMALL_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
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
    print(f"total {total / 2**20:.2f} MiB in {args.out}")


if __name__ == "__main__":
    main()
