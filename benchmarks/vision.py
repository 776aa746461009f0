"""Images: how fast the vision encoder takes them, and the time to first
token of a request with one image, fresh and with the image cached.

The Qwen2.5-VL-3B shape (a 32-block ViT of width 1280 with window attention,
a 36-layer decoder of width 2048, the real vocabulary's size) with dummy
weights, or the tests' tiny one; the tests' fixture tokenizer and
Qwen2VLImageProcessor at its published pixel bounds (a 448x448 image is
1024 patches, 256 tokens). Through the offline API: `engine.model.encode_images`
for the encoder alone (images per second, one image a call and four), then
`LLM.generate` with `multi_modal_data` and max_tokens 1 (time to first
token), then the same request again (its image's KV from the prefix cache).

    python benchmarks/vision.py                       # the 3B shape, bfloat16
    python benchmarks/vision.py --shape tiny --dtype float32 --png vision.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixture's tokenizer

from cpu_limits import describe_machine  # noqa: E402
from vision_checkpoints import _write_tokenizer  # noqa: E402

from aioserve import LLM, SamplingParams  # noqa: E402
from aioserve.cpu.isa import cpu_flags  # noqa: E402

MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2.5-VL-3B-Instruct's config.json, less what does not matter here.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": {
        "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
        "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                   "out_hidden_size": 2048, "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112},
    },
    "tiny": {
        "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 342, "tie_word_embeddings": False},
        "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                   "fullatt_block_indexes": [1], "window_size": 56},
    },
}
VISION_COMMON = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                 "hidden_act": "silu", "tokens_per_second": 2}
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056,
             "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "do_resize": True, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
             "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


@dataclass
class Row:
    what: str
    seconds: float
    per: str

    def line(self) -> str:
        return f"| {self.what} | {self.seconds:.3f} s | {self.per} |"


def model_folder(shape: str, root: Path) -> Path:
    folder = root / shape
    ids = _write_tokenizer(folder)
    spec = SHAPES[shape]
    text = {**spec["text"], "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24] if shape != "tiny" else [2, 3, 3]}}
    if shape == "tiny":
        text["head_dim"] = 16
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **text,
        "vision_config": {**VISION_COMMON, **spec["vision"]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2))
    return folder


def noise(seed: int, side: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8))


def timed(work: Any) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[Row]:
    root = Path(tempfile.mkdtemp(prefix="aioserve-vision-"))
    folder = model_folder(args.shape, root)
    llm = LLM(str(folder), load_format="dummy", dtype=args.dtype, max_prefill_tokens=args.max_prefill_tokens)
    rows: list[Row] = []
    try:
        assert llm.images is not None
        processor = llm.images.intake.processor
        model = llm.engine.model
        images = [processor(noise(seed, args.side)) for seed in range(8)]
        tokens = images[0].num_tokens

        def encode(batch: list[Any]) -> None:
            with torch.inference_mode():
                model.encode_images([{k: t.to(llm.engine.device) for k, t in im.tensors.items()} for im in batch])

        encode(images[:1])  # warm-up
        one = min(timed(lambda: encode(images[i:i + 1])) for i in range(1, 3))
        four = timed(lambda: encode(images[4:8]))
        rows.append(Row(f"encode one {args.side}x{args.side} image ({tokens} tokens)", one, f"{1 / one:.2f} images/s"))
        rows.append(Row("encode four in one call", four, f"{4 / four:.2f} images/s"))
        prompt = f"<|im_start|>user\n{MARKER}Describe the picture.<|im_end|>\n<|im_start|>assistant\n"
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        request = {"prompt": prompt, "multi_modal_data": {"image": noise(100, args.side)}}
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": noise(99, args.side)}}, params)  # warm-up
        fresh = timed(lambda: llm.generate(request, params))
        cached = timed(lambda: llm.generate(request, params))
        rows.append(Row("time to first token, one image", fresh, "encode + prefill"))
        rows.append(Row("the same request again", cached, f"image cached: {fresh / cached:.1f}x faster"))
    finally:
        llm.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-3b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--side", type=int, default=448, help="the test images' side in pixels")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--png", help="write a bar chart here")
    args = p.parse_args()
    rows = run(args)
    machine = describe_machine(cpu_flags())
    print(f"\n{args.shape}, {args.dtype}; {machine.cpu} ({', '.join(machine.flags)}), {machine.threads} threads\n")
    print("| what | seconds | |\n|---|---|---|")
    for row in rows:
        print(row.line())
    if args.png:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3))
        ax.barh([r.what for r in rows], [r.seconds for r in rows])
        ax.set_xlabel("seconds")
        fig.tight_layout()
        fig.savefig(args.png)


if __name__ == "__main__":
    main()
