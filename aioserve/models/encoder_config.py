"""What an encoder (BERT, XLM-R) needs beyond a decoder's config: read from
the same config.json, None for every other model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> whether its tokenizer gives the second text of a pair token
# type 1 (BERT's `[CLS] A [SEP] B [SEP]`); RoBERTa's gives 0 throughout.
ENCODER_MODEL_TYPES: dict[str, bool] = {"bert": True, "roberta": False, "xlm-roberta": False}
# Position ids of RoBERTa-style models start after the padding id (fairseq's
# convention, which Hugging Face keeps): the first token is at padding_idx + 1.
OFFSET_POSITIONS = ("roberta", "xlm-roberta")


@dataclass
class EncoderConfig:
    layer_norm_eps: float
    type_vocab_size: int
    # Added to the engine's 0-based positions to index the position table:
    # XLM-R's padding_idx + 1 (= 2), BERT's 0.
    position_offset: int
    # Token types derived from [SEP] (models/bert.py's pair_token_types):
    # only where the tokenizer marks a pair's second text with type 1.
    pair_token_types: bool
    # The [SEP] id: config.json's, else the checkpoint's tokenizer files'
    # (ModelConfig.from_path); None if neither names it (every token type 0).
    sep_token_id: int | None
    num_labels: int  # a sequence classifier's outputs (HF's default 2 without id2label)

    @property
    def derives_token_types(self) -> bool:
        return self.pair_token_types and self.type_vocab_size > 1 and self.sep_token_id is not None


def encoder_config(raw: dict[str, Any]) -> EncoderConfig | None:
    model_type = str(raw.get("model_type", ""))
    if model_type not in ENCODER_MODEL_TYPES:
        return None
    kind = raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{model_type}: position_embedding_type {kind!r} is not supported (only absolute)")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise ValueError(f"{model_type}: a decoder or cross-attention configuration is not supported")
    pad = raw.get("pad_token_id")
    offset = int(pad if pad is not None else 1) + 1 if model_type in OFFSET_POSITIONS else 0
    labels = raw.get("id2label")
    return EncoderConfig(
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        position_offset=offset,
        pair_token_types=ENCODER_MODEL_TYPES[model_type],
        sep_token_id=raw.get("sep_token_id"),
        num_labels=len(labels) if labels else int(raw.get("num_labels", 2)),
    )
