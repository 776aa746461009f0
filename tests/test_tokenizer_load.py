"""load_hf_tokenizer (the config.json read as transformers' base config, so
that a server's start skips AutoConfig's imports) gives the tokenizer that
AutoTokenizer.from_pretrained gives: same class, ids, specials and chat
template, for every tokenizer the tests have."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from aioserve.tokenizer import load_hf_tokenizer

from conftest import SHARED
from real_vocab_models import REAL_VOCAB, build_fixture_tokenizer
TEXT = "Hello world! <|im_end|> Once upon a time, 1234 \n\n  spaces <s></s> café 🙂"


def _folders(tiny_checkpoints: dict[str, Path], root: Path) -> list[Path]:
    """The tests' tokenizers, Qwen3's and Llama 3's (small vocabularies, real
    templates and specials), and the full published ones where shared/ has them."""
    shared = [SHARED / "tokenizers" / name for name in ("llama3-8b-instruct", "qwen3", "tinyllama-v1.1")]
    shared.append(SHARED / "models" / "stories260K")
    for name in REAL_VOCAB:
        build_fixture_tokenizer(name, root / name)
    fixtures = [root / name for name in REAL_VOCAB]
    return [p for p in shared if p.is_dir()] + fixtures + list(tiny_checkpoints.values())


def test_the_light_load_gives_autotokenizers_tokenizer(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folders = _folders(tiny_checkpoints, tmp_path)
    assert len(folders) >= len(tiny_checkpoints) + len(REAL_VOCAB)
    for folder in folders:
        light, plain = load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
        assert type(light) is type(plain), folder
        assert light.encode(TEXT) == plain.encode(TEXT), folder
        assert len(light) == len(plain) and light.all_special_ids == plain.all_special_ids, folder
        assert light.chat_template == plain.chat_template, folder
        if plain.chat_template:
            messages = [{"role": "user", "content": "hi"}]
            assert light.apply_chat_template(messages, tokenize=False) == plain.apply_chat_template(
                messages, tokenize=False
            ), folder


def test_a_config_the_light_load_cannot_use_falls_back(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("a config the base class cannot read")

    monkeypatch.setattr(transformers.PreTrainedConfig, "from_pretrained", refuse)
    folder = tiny_checkpoints["qwen3"]
    tokenizer = load_hf_tokenizer(folder)  # through AutoConfig, as before
    assert tokenizer.encode(TEXT) == AutoTokenizer.from_pretrained(str(folder)).encode(TEXT)
