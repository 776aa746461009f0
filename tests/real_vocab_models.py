"""Tiny random-weight checkpoints with the real Qwen3 and Llama 3 vocabularies
and chat templates (shared/tokenizers), for constrained decoding, tool calls
and reasoning: what matters there is the real tokenizer, not the weights.

The vocabularies are large (151,936 and 128,256 rows), so the models are as
small as the engine allows: one layer, hidden size 64, tied embeddings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# name -> (folder under shared/tokenizers, config class, extra config fields)
REAL_VOCAB: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("qwen3", "Qwen3Config", {"head_dim": 16, "vocab_size": 151936, "eos_token_id": 151645}),
    "llama3": ("llama3-8b-instruct", "LlamaConfig", {"vocab_size": 128256, "eos_token_id": 128009, "bos_token_id": 128000}),
}

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=True,
)


def build_real_vocab_checkpoint(name: str, shared: Path, folder: Path, seed: int = 0) -> Path:
    import transformers

    source, config_class, extra = REAL_VOCAB[name]
    folder.mkdir(parents=True, exist_ok=True)
    for file in TOKENIZER_FILES:
        if (shared / "tokenizers" / source / file).exists():
            shutil.copy(shared / "tokenizers" / source / file, folder / file)
    config = getattr(transformers, config_class)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    # save_pretrained may rewrite generation_config.json; keep the real one's eos list.
    if (shared / "tokenizers" / source / "generation_config.json").exists():
        shutil.copy(shared / "tokenizers" / source / "generation_config.json", folder / "generation_config.json")
    json.loads((folder / "config.json").read_text())  # written and readable
    return folder


def real_vocab_checkpoint(name: str, shared: Path, root: Path) -> Path:
    """The checkpoint under `root` (a session's temp folder), built on first use:
    several test modules share one build."""
    folder = root / f"real-vocab-{name}"
    if not (folder / "model.safetensors").exists():
        if not (shared / "tokenizers" / REAL_VOCAB[name][0] / "tokenizer.json").exists():
            import pytest

            pytest.skip(f"the {name} tokenizer is not in {shared / 'tokenizers'}")
        build_real_vocab_checkpoint(name, shared, folder)
    return folder
