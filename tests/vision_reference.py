"""transformers' own answer for a chat with images: the prompt ids its
processor would build (the chat template, then each image's tokens as the
checkpoint's processor places them) and its greedy tokens, fp32 on CPU.
Without torchvision transformers' AutoProcessor does not load (its video
processor needs it), so the processor's two halves are called here as it
calls them."""

from __future__ import annotations

import io
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from PIL import Image


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


@lru_cache(maxsize=4)
def _loaded(folder: str) -> tuple[Any, Any, Any, dict]:
    import transformers

    config = json.loads((Path(folder) / "config.json").read_text())
    arch = config["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    images = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    return model, tokenizer, images, config


def reference(folder: Path, messages: list[dict], images: list[bytes], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids) of transformers for `messages`, whose
    image parts are `{"type": "image"}`, filled by `images` in order."""
    model, tokenizer, processor, config = _loaded(str(folder))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs: dict[str, Any] = {}
    if images:
        inputs = dict(processor(images=[pil(b) for b in images], return_tensors="pt"))
    if "Qwen2_5_VL" in config["architectures"][0]:
        parts = text.split("<|image_pad|>")
        text = parts[0]
        grids = inputs["image_grid_thw"].tolist() if images else []
        merge = config["vision_config"].get("spatial_merge_size", 2)
        for (t, h, w), rest in zip(grids, parts[1:]):
            text += "<|image_pad|>" * (t * h * w // merge**2) + rest
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        extra = {"mm_token_type_ids": (ids == config["image_token_id"]).int()}
    else:  # Gemma 3: <start_of_image> becomes the image's whole sequence, in the text
        count = config.get("mm_tokens_per_image", 256)
        text = text.replace("<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * count + "<end_of_image>\n\n")
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        extra = {"token_type_ids": (ids == config["image_token_index"]).long()}
        inputs.pop("num_crops", None)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs, **extra,
                             max_new_tokens=max_new_tokens, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()
