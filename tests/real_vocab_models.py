"""Tiny random-weight checkpoints with the Qwen3 and Llama 3 tokenizers' chat
templates, special tokens and pre-tokenizers, for constrained decoding, tool
calls and reasoning: what matters there is the real template and specials,
not the weights or the size of the vocabulary.

By default the tokenizers are built here from tests/fixtures/real_tokenizers.json
(each one's tokenizer_config.json, its added tokens in their order, and the
normalizer, pre-tokenizer, post-processor and decoder of its tokenizer.json,
copied from the published files): a byte-level BPE of ~1,300 tokens trained on
a small corpus with the real pre-tokenizer, then the real special tokens. So
the suite needs nothing outside the repository. AIOSERVE_FULL_TOKENIZERS=1
uses the full published tokenizers (151,936 and 128,256 rows) from
shared/tokenizers instead, when they are there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tiny_models import CORPUS

FIXTURE = Path(__file__).parent / "fixtures" / "real_tokenizers.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# name -> (folder under shared/tokenizers, config class, extra config fields)
REAL_VOCAB: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("qwen3", "Qwen3Config", {"head_dim": 16}),
    "llama3": ("llama3-8b-instruct", "LlamaConfig", {}),
}

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=True,
)

# What the tests ask these models for: JSON, tool calls, thinking, English and other scripts.
TRAINING_TEXT = CORPUS + """
{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "unit": "celsius"}}
{"type": "object", "properties": {"answer": {"type": "string"}, "count": {"type": "integer"}}, "required": ["answer"]}
[true, false, null, 3.14, -17, "yes", "no"] The user asks about the weather in Paris and Tokyo.
Let me think step by step. First, the question; then the answer is 42.
""" + (
    # Whole non-ASCII characters as tokens, as a real vocabulary has many.
    "Größe señor façade smörgåsbord déjà vu peut-être ✓ Ελληνικά русский язык 日本語のテキスト 한국어 "
    "العربية עברית 中文 世界 你好 🙂 🚀 ñ ü ö ä é è à ç ß ø å\n"
    # Greek, Cyrillic and 400 CJK characters: a real vocabulary's share of non-ASCII tokens (a third or more).
    + " ".join(chr(c) for c in [*range(0x391, 0x3CA), *range(0x410, 0x450), *range(0x4E00, 0x4E00 + 400)]) + "\n"
) * 3
BPE_VOCAB = 2048


def _fixture(name: str) -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())[name]


def _with_ids(node: Any, ids: dict[str, int]) -> Any:
    """The post-processor's special-token ids, renumbered for this vocabulary."""
    if isinstance(node, list):
        return [_with_ids(item, ids) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _with_ids(value, ids) for key, value in node.items()}
    if "ids" in node and "tokens" in node:
        node["ids"] = [ids[token] for token in node["tokens"]]
    return node


def build_fixture_tokenizer(name: str, folder: Path) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json
    for `name` into `folder`; returns the special tokens' ids by content."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers, trainers

    spec = _fixture(name)
    empty_bpe = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
        "ignore_merges": spec["ignore_merges"], "vocab": {}, "merges": [],
    }
    document = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": spec["normalizer"], "pre_tokenizer": spec["pre_tokenizer"], "post_processor": None,
        "decoder": spec["decoder"], "model": empty_bpe,
    }
    tokenizer = Tokenizer.from_str(json.dumps(document))
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    # Paragraphs, newlines kept: templates write "\n\n", one token in the real vocabularies.
    tokenizer.train_from_iterator(["\n\n".join(TRAINING_TEXT.splitlines())], trainer)
    # The added tokens after the learned vocabulary, in the published order, as there.
    tokenizer.add_tokens(
        [AddedToken(t["content"], special=t["special"], normalized=False) for t in spec["added_tokens"]]
    )
    ids = {t["content"]: tokenizer.token_to_id(t["content"]) for t in spec["added_tokens"]}
    document = json.loads(tokenizer.to_str())
    document["post_processor"] = _with_ids(spec["post_processor"], ids)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(spec["tokenizer_config"], ensure_ascii=False))
    if "generation_config" in spec:
        generation = {
            key: ([ids[v] for v in value] if isinstance(value, list) else ids[value]) if key.endswith("token_id") else value
            for key, value in spec["generation_config"].items()
        }
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return ids


def _full_tokenizer(name: str, shared: Path) -> Path | None:
    folder = shared / "tokenizers" / REAL_VOCAB[name][0]
    wanted = os.environ.get("AIOSERVE_FULL_TOKENIZERS") == "1"
    return folder if wanted and (folder / "tokenizer.json").exists() else None


def build_real_vocab_checkpoint(
    name: str, shared: Path, folder: Path, seed: int = 0, model: tuple[str, dict] | None = None
) -> Path:
    """`model`: another config class and its fields in place of REAL_VOCAB's
    (a Qwen3-MoE with Qwen3's tokenizer, say)."""
    import transformers
    from tokenizers import Tokenizer

    _, config_class, extra = REAL_VOCAB[name]
    if model is not None:
        config_class, extra = model
    folder.mkdir(parents=True, exist_ok=True)
    full = _full_tokenizer(name, shared)
    if full is not None:
        for file in TOKENIZER_FILES:
            if (full / file).exists():
                shutil.copy(full / file, folder / file)
    else:
        build_fixture_tokenizer(name, folder)
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = {key: vocab.token_to_id(value) for key, value in _fixture(name)["config_tokens"].items()}
    config = getattr(transformers, config_class)(vocab_size=vocab.get_vocab_size(), **tokens, **{**TINY, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config).eval()
    generation = (folder / "generation_config.json").read_text() if (folder / "generation_config.json").exists() else None
    model.save_pretrained(folder, safe_serialization=True)
    # save_pretrained may rewrite generation_config.json; keep the real one's eos list.
    if generation is not None:
        (folder / "generation_config.json").write_text(generation)
    return folder


def real_vocab_checkpoint(name: str, shared: Path, root: Path, model: tuple[str, dict] | None = None) -> Path:
    """The checkpoint under `root` (a session's temp folder), built on first use:
    several test modules share one build. `model`: as build_real_vocab_checkpoint's."""
    folder = root / (f"real-vocab-{name}" + (f"-{model[0]}" if model else ""))
    if not (folder / "model.safetensors").exists():
        build_real_vocab_checkpoint(name, shared, folder, model=model)
    return folder
