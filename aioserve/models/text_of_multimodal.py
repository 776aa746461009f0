"""Checkpoints that wrap a text model with a vision tower: Gemma 3 4B-27B
(`Gemma3ForConditionalGeneration`) is Gemma 3's text decoder plus a SigLIP
encoder whose image embeddings replace image tokens. The decoder is read as
the text model's own: the config's `text_config` (with the text model's
defaults filled in, as transformers reads it) and the language model's
weights under its names. With a `vision_config` the tower and its projector
load beside it (models/gemma3_vl.py, vision_weight_name); a wrapper without
one is served as its text model.
"""

from __future__ import annotations

from typing import Any

from aioserve.hf_imports import HF_IMPORT_LOCK

# The wrapper's architecture -> the architecture of the text model inside it.
TEXT_MODEL_OF: dict[str, str] = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}

# Where the wrapper's checkpoints keep the text model's tensors: the published
# layout (language_model.model.*) and the one transformers >= 4.52 builds in
# memory (model.language_model.*), mapped to the text model's names.
_TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION_PREFIXES: tuple[str, ...] = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
)
# Top-level fields that hold for the text model too (the wrapper's config.json
# keeps its EOS ids and quantisation there, not in text_config).
_SHARED_FIELDS: tuple[str, ...] = (
    "eos_token_id", "bos_token_id", "pad_token_id", "quantization_config", "compression_config", "dtype", "torch_dtype",
)


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as the text model's own: unchanged unless its architecture
    wraps a text model, else that model's `text_config` with transformers'
    defaults for the fields it leaves out (a hub text_config lists only what
    differs from them: Gemma 3 4B's has no head count or head_dim)."""
    wrapper = (raw.get("architectures") or [None])[0]
    if wrapper not in TEXT_MODEL_OF:
        return raw
    text = dict(raw.get("text_config") or {})
    model_type = text.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{wrapper}: config.json's text_config names no model_type")
    with HF_IMPORT_LOCK:  # the tokenizer may be loading on another thread
        from transformers import AutoConfig  # noqa: PLC0415 - only wrapped checkpoints need it

        filled: dict[str, Any] = AutoConfig.for_model(model_type, **text).to_dict()
    filled.update({key: raw[key] for key in _SHARED_FIELDS if raw.get(key) is not None})
    filled["architectures"] = [TEXT_MODEL_OF[wrapper]]
    filled["model_type"] = model_type
    return filled


def vision_weight_name(name: str) -> str | None:
    """A wrapper checkpoint's vision tensor under the whole model's names
    (`vision_tower.*`, `multi_modal_projector.*`); None for a text tensor."""
    if not name.startswith(_VISION_PREFIXES):
        return None
    name = name.removeprefix("model.")
    # The published checkpoints nest SigLIP's tower (vision_tower.vision_model.*);
    # transformers 5 saves it one level flatter (vision_tower.*).
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return name


def text_weight_name(name: str) -> str | None:
    """A wrapper checkpoint's tensor name as the text model's; None for the
    vision tower's and its projector's (not loaded)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name
