"""Pooling models on a GPU (issue 41): the default backend (FlashInfer: its
non-causal ragged prefill for an encoder, its paged prefill for a decoder)
in bfloat16, and the torch backend on CUDA in float32, embed as the CPU does
in float32. No sentence-transformers here (the GPU machine lacks it): the
folders' layout is written by hand and the CPU run is the reference
(tests/test_embeddings.py holds the CPU equal to sentence-transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM
from pooling_checkpoints import bert_model_folder, hand_written_layout
from tiny_models import build_checkpoint

TEXTS = ["the cat sat on the mat", "a dog ran far away", "what is where", "x"]


def _embed(folder: Path, **options) -> torch.Tensor:
    llm = LLM(str(folder), page_size=16, **options)
    try:
        return torch.tensor([o.embedding for o in llm.embed(TEXTS)])
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["bert-cls", "bert-mean", "qwen3-last"])
def test_embeddings_on_cuda_equal_the_cpu(tmp_path: Path, family: str) -> None:
    if family.startswith("bert"):
        folder = hand_written_layout(bert_model_folder(tmp_path), family.split("-")[1])
    else:
        folder = hand_written_layout(build_checkpoint("qwen3", tmp_path / "qwen3", overrides={
            "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}), "lasttoken")
    expected = _embed(folder, device="cpu", dtype="float32")
    exact = _embed(folder, device="cuda", dtype="float32", attention_backend="torch_native")
    assert torch.nn.functional.cosine_similarity(exact, expected).min() >= 0.99999
    half = _embed(folder, device="cuda", dtype="bfloat16")
    assert torch.nn.functional.cosine_similarity(half, expected).min() >= 0.99
