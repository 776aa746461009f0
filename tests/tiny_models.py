"""Tiny random-weight Hugging Face checkpoints, built by the tests themselves.

Each is a real `save_pretrained` folder (config.json, safetensors, a trained
byte-level BPE tokenizer with a ChatML chat template), seeded so every run
builds the same bytes. They cover the architectures and config features the
engine must handle: GQA, llama3 rope scaling, untied and tied embeddings, a
sharded checkpoint with an index, Mistral's sliding window, Qwen2's q/k/v
bias and Qwen3's q/k norms.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = """Once upon a time there was a little robot who loved to read books about the sea.
Every morning the robot walked to the library, opened a big blue book and read about fish,
whales, boats and storms. One day the librarian asked: what will you do when you finish all
the books? The robot smiled and said that it would write a new one, about a robot who reads.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ! ? , . ;
Héllo wörld, naïve café, 世界 你好, emoji 🙂 🚀 and the end of the story.
""" * 4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.08,  # wider than HF's 0.02: decisive logits, no near-ties in greedy
)

# name -> (config class name, extra config fields, save options)
ARCHITECTURES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}, {}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {"max_shard_size": "60KB"},  # several shards + model.safetensors.index.json
    ),
    "mistral": ("MistralConfig", {"sliding_window": 24, "tie_word_embeddings": False}, {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}, {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, {}),
}


def build_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on CORPUS and save it with a chat template;
    returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": TINY["max_position_embeddings"],
            }
        )
    )
    return tokenizer.get_vocab_size()


def build_checkpoint(name: str, folder: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write the tiny `name` checkpoint (see ARCHITECTURES) into `folder`,
    with `overrides` on its config fields (other shapes of the same family)."""
    import transformers

    config_class, extra, save_options = ARCHITECTURES[name]
    from tokenizers import Tokenizer

    vocab = build_tokenizer(folder)
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    fields = {**TINY, **extra, **(overrides or {})}
    # A few embedding rows beyond the tokenizer, as real checkpoints often have.
    config = getattr(transformers, config_class)(vocab_size=vocab + 8, eos_token_id=eos, bos_token_id=None, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config).eval()
    model.save_pretrained(folder, safe_serialization=True, **save_options)
    return folder
