"""Images for tests, and a small folder that takes them (no weights).

`png_data_url(width, height, seed)` is what an HTTP test puts in an image
part; `build_vl_intake_folder(folder)` writes what intake reads of a
Qwen2.5-VL checkpoint: config.json (architecture, image token id, merge
size), preprocessor_config.json (Qwen2VLImageProcessor, small bounds so
images stay a few dozen tokens) and a trained byte-level BPE tokenizer with
Qwen2.5-VL's special tokens and a chat template that writes
<|vision_start|><|image_pad|><|vision_end|> for each image part, as the
published one does. (The full tiny checkpoint, with weights, is
tests/vision_checkpoints.py's.) Nothing here touches the network.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from tiny_models import ChatFormat, build_tokenizer

QWEN_VL_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)
IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"

# Qwen2.5-VL's template in short: a string content as is; a list's text
# parts as is and each image part as the marker.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_VL_CHAT = ChatFormat(QWEN_VL_SPECIALS, "<|im_end|>", None, QWEN_VL_TEMPLATE)

# Qwen2VLImageProcessor with a pixel budget of 56*56 to 28*28*64: an image
# becomes 4 to 64 merged tokens (patch 14, merge 2, temporal patch 2).
PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 64,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def build_vl_intake_folder(folder: Path) -> Path:
    """config.json, preprocessor_config.json and the tokenizer (see the module's docstring)."""
    from tokenizers import Tokenizer

    build_tokenizer(folder, chat=QWEN_VL_CHAT)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "image_token_id": ids.token_to_id("<|image_pad|>"),
        "video_token_id": ids.token_to_id("<|video_pad|>"),
        "vision_start_token_id": ids.token_to_id("<|vision_start|>"),
        "vision_end_token_id": ids.token_to_id("<|vision_end|>"),
        "vision_config": {"spatial_merge_size": 2, "patch_size": 14, "temporal_patch_size": 2},
        "text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
    return folder


# -- images ------------------------------------------------------------------------------------


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A noise image of this size (the same bytes for the same seed)."""
    channels = len(mode)
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_data_url(width: int, height: int, seed: int = 0) -> str:
    """An image part's URL for an HTTP test: a noise PNG, inline."""
    return data_url(image_bytes(width, height, seed))


def image_part(url: str) -> dict:
    """An OpenAI chat content part holding the image at `url`."""
    return {"type": "image_url", "image_url": {"url": url}}


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height and holds one row of data: what a
    decompression bomb looks like before it is decoded (a few dozen bytes)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    data = zlib.compress(b"\0" + b"\0" * 3 * min(width, 16))
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def gif_bomb(size: int = 65535) -> bytes:
    """A 1x1 GIF whose logical screen claims size x size."""
    out = io.BytesIO()
    Image.new("P", (1, 1)).save(out, "GIF")
    data = bytearray(out.getvalue())
    data[6:10] = struct.pack("<HH", size, size)
    return bytes(data)


def animated_gif(colors: list[tuple[int, int, int]], size: int = 32) -> bytes:
    frames = [Image.new("RGB", (size, size), color) for color in colors]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return out.getvalue()
