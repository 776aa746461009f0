"""Tiny random-weight vision-language checkpoints, built by the tests
themselves through transformers' own classes: nothing outside the
repository is read.

`write_qwen2_5_vl` writes a Qwen2.5-VL folder as the published ones are
laid out: config.json (text fields in `text_config`, as transformers 5
saves it), safetensors, a preprocessor_config.json for Qwen2VLImageProcessor
with a small pixel budget (an image is a few dozen placeholder tokens), and
a byte-level BPE tokenizer trained on the tests' corpus with Qwen2.5-VL's
special tokens after it and its chat template (image parts ->
<|vision_start|><|image_pad|><|vision_end|>). Seeded: the same bytes every run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tiny_models import CORPUS

# Qwen2.5-VL's added tokens, in the published order (after the learned vocabulary there too).
QWEN2_5_VL_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# The chat template published with Qwen2.5-VL's instruct checkpoints: a
# default system turn, content either a string or a list of parts, an image
# part (`image`, `image_url`) one <|image_pad|> between the vision markers
# (the intake widens it to the image's tokens).
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Pixels per image: 56*56 .. 28*28*64, i.e. 4 .. 64 placeholder tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64

TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-6,
    initializer_range=0.08,  # wider than HF's 0.02: decisive logits, no near-ties in greedy
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1_000_000.0},
)
# Windows of 56 pixels: 2 x 2 merge blocks, so window attention splits even small images.
VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, temporal_patch_size=2,
    spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1], out_hidden_size=64, initializer_range=0.08,
)


def _write_tokenizer(folder: Path) -> dict[str, int]:
    """A byte-level BPE trained on the corpus, then the specials; returns their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_5_VL_SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": QWEN2_5_VL_TEMPLATE, "model_max_length": TEXT["max_position_embeddings"],
    }))
    ids = {token: tokenizer.token_to_id(token) for token in QWEN2_5_VL_SPECIALS}
    ids["vocab_size"] = tokenizer.get_vocab_size()
    return ids


def _write_image_processor(folder: Path) -> None:
    """preprocessor_config.json as published (min_pixels, max_pixels) with
    transformers 5's `size` beside them: written out, not by a processor
    class, so any transformers that serves Qwen2.5-VL reads it (the GPU
    machine's is another version than this one's)."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def write_qwen2_5_vl(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny Qwen2_5_VLForConditionalGeneration into `folder`; returns it.
    `overrides`: config fields (`text_config` / `vision_config` entries are
    merged into the tiny ones; others set on the top-level config)."""
    import transformers

    ids = _write_tokenizer(folder)
    text = {**TEXT, **overrides.pop("text_config", {})}
    vision = {**VISION, **overrides.pop("vision_config", {})}
    eos, bos = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = transformers.Qwen2_5_VLConfig(
        text_config={**text, "vocab_size": ids["vocab_size"] + 8, "eos_token_id": eos, "bos_token_id": bos},
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos, bos_token_id=bos, tie_word_embeddings=False, **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # norms start at 1: make their weights matter
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.normal_(1.0, 0.2)
    model.generation_config.eos_token_id = [eos, bos]  # as published: <|im_end|> and <|endoftext|>
    model.save_pretrained(folder, safe_serialization=True)
    _write_image_processor(folder)
    return folder
