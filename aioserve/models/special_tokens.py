"""A special token's id read off a checkpoint folder's tokenizer files,
without loading a tokenizer: the model needs BERT's [SEP] id to tell a
pair's two texts apart (models/bert.py), and the loader only has the folder.

The token's text comes from tokenizer_config.json or special_tokens_map.json
(a string, or a dict with its `content`), else from tokenizer.json's
post-processor (BertProcessing / RobertaProcessing name `sep` as
[text, id]); its id from tokenizer_config.json's `added_tokens_decoder`,
tokenizer.json's `added_tokens` or vocabulary (WordPiece/BPE: a dict;
Unigram, XLM-R's: a list of [piece, score]), or a slow tokenizer's vocab.txt.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _processor_token(tokenizer: dict[str, Any], role: str) -> tuple[str, int] | None:
    """`sep` / `cls` of a BertProcessing or RobertaProcessing post-processor
    (also inside a Sequence of processors), as (text, id)."""
    processor = tokenizer.get("post_processor") or {}
    candidates = (processor.get("processors") or [processor]) if isinstance(processor, dict) else []
    for candidate in candidates:
        pair = candidate.get(role.removesuffix("_token")) if isinstance(candidate, dict) else None
        if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int):
            return str(pair[0]), pair[1]
    return None


def _id_of(path: Path, text: str, config: dict[str, Any], tokenizer: dict[str, Any]) -> int | None:
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if _content(entry) == text and str(key).isdigit():
            return int(key)
    for entry in tokenizer.get("added_tokens") or []:
        if isinstance(entry, dict) and entry.get("content") == text and isinstance(entry.get("id"), int):
            return int(entry["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return int(vocab[text])
    if isinstance(vocab, list):
        for index, piece in enumerate(vocab):
            if isinstance(piece, list) and piece and piece[0] == text:
                return index
    vocab_txt = path / "vocab.txt"
    if vocab_txt.exists():
        for index, line in enumerate(vocab_txt.read_text(encoding="utf-8").splitlines()):
            if line.strip() == text:
                return index
    return None


def special_token_id(path: Path, role: str) -> int | None:
    """The id of the tokenizer's `role` token (`sep_token`, `cls_token`, ...)
    in the checkpoint folder `path`; None (logged) where its files do not say."""
    config = _read_json(path / "tokenizer_config.json")
    tokenizer = _read_json(path / "tokenizer.json")
    text = _content(config.get(role)) or _content(_read_json(path / "special_tokens_map.json").get(role))
    processed = _processor_token(tokenizer, role)
    if text is None and processed is not None:
        return processed[1]
    found = _id_of(path, text, config, tokenizer) if text is not None else None
    if found is None and processed is not None and processed[0] == text:
        found = processed[1]
    if found is None:
        logger.debug("%s: no %s id in config.json or the tokenizer files (%s)", path, role,
                       f"{text!r} not in its vocabulary" if text else "none named")
    return found
