"""What a vision-language checkpoint's config.json says beyond its text
model (Qwen2.5-VL): the vision tower's own fields, the image placeholder
tokens, the M-RoPE sections.

Unlike the wrappers of text_of_multimodal.py (served as their text model,
the tower left on disk), these are served whole: the text decoder is read
from the text fields as any decoder's, and `VisionConfig` keeps the rest.
transformers 5 nests the text fields in `text_config`; the published
Qwen2.5-VL configs (written by transformers 4) keep them at the top level
beside `vision_config`. Both read alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures served with their vision tower.
VISION_LANGUAGE_ARCHITECTURES: frozenset[str] = frozenset({"Qwen2_5_VLForConditionalGeneration"})

# transformers' defaults where a config leaves a field out (Qwen2_5_VLConfig, Qwen2_5_VLTextConfig).
_DEFAULT_IDS = {"image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653}
_DEFAULT_MROPE_SECTION = (16, 24, 24)
_DEFAULT_TEXT_THETA = 1_000_000.0


@dataclass
class VisionConfig:
    """The vision side of a vision-language checkpoint: what its tower is
    built from and what the request intake needs to place an image."""

    raw: dict[str, Any]  # config.json's vision_config as written (the tower reads its sizes from it)
    image_token_id: int  # the placeholder each merged patch of an image takes in the prompt (<|image_pad|>)
    vision_start_token_id: int  # <|vision_start|>, before an image's placeholders
    vision_end_token_id: int  # <|vision_end|>, after them
    mrope_section: tuple[int, ...]  # rotary frequencies per position axis (time, height, width); () without M-RoPE
    spatial_merge_size: int  # patches merged per side into one placeholder token (2: 2x2 patches)
    # Gemma 3: every image is this many placeholder tokens (one fixed-size crop)
    # between its start and end tokens; None: the count follows the image's size.
    tokens_per_image: int | None = None
    # The placeholders of one image attend to each other both ways (Gemma 3).
    both_ways: bool = False


def _rope_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The text rope's fields, whichever key the config keeps them under."""
    return dict(text.get("rope_parameters") or text.get("rope_scaling") or {})


def vision_language_config(raw: dict[str, Any]) -> tuple[dict[str, Any], VisionConfig | None]:
    """(the text model's fields, the vision facts) of config.json; a config
    that is not a vision-language one comes back unchanged, with None."""
    arch = (raw.get("architectures") or [None])[0]
    if arch not in VISION_LANGUAGE_ARCHITECTURES:
        return raw, None
    nested = dict(raw.get("text_config") or {})
    text = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    text.update(nested)
    # transformers ties the head when either level says so (pre-5 saves put it in text_config).
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings")) or bool(nested.get("tie_word_embeddings"))
    text["architectures"] = [arch]
    rope = _rope_fields(text)
    rope.setdefault("rope_theta", text.get("rope_theta") or _DEFAULT_TEXT_THETA)
    section = tuple(rope.get("mrope_section") or _DEFAULT_MROPE_SECTION)
    rope["mrope_section"] = list(section)
    text["rope_parameters"] = rope
    text.pop("rope_scaling", None)
    vision_raw = dict(raw.get("vision_config") or {})
    ids = {key: int(raw[key]) if raw.get(key) is not None else default for key, default in _DEFAULT_IDS.items()}
    vision = VisionConfig(
        raw=vision_raw,
        image_token_id=ids["image_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        mrope_section=section,
        spatial_merge_size=int(vision_raw.get("spatial_merge_size", 2)),
    )
    return text, vision


def gemma3_vision_config(raw: dict[str, Any]) -> VisionConfig | None:
    """Gemma3ForConditionalGeneration's vision facts (None without a
    `vision_config`): a SigLIP tower, `mm_tokens_per_image` soft tokens per
    image (`image_token_index`) between `<start_of_image>` and `<end_of_image>`,
    attending to each other both ways. transformers' defaults where the
    config leaves a field out (Gemma3Config)."""
    if (raw.get("architectures") or [None])[0] != "Gemma3ForConditionalGeneration" or not raw.get("vision_config"):
        return None
    return VisionConfig(
        raw=dict(raw["vision_config"]),
        image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 262144))),
        vision_start_token_id=int(raw.get("boi_token_index", 255999)),
        vision_end_token_id=int(raw.get("eoi_token_index", 256000)),
        mrope_section=(),
        spatial_merge_size=1,
        tokens_per_image=int(raw.get("mm_tokens_per_image", 256)),
        both_ways=True,
    )
