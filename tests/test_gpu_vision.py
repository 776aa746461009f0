"""Images on a GPU (issue 43): Qwen2.5-VL's tower and M-RoPE prefill, and
Gemma 3's image tokens attended both ways (FlashInfer's custom mask), on
CUDA. In float32 with the torch backend a chat with two images equals the
CPU token for token; with the default backend (FlashInfer, CUDA graphs for
the decodes) in bfloat16 its first token equals the CPU's. Head dims of 64:
FlashInfer's paged kernels take no smaller."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioserve import LLM, SamplingParams
from image_fixtures import data_url, image_bytes, image_part
from tiny_models import build_gemma3_multimodal
from vision_checkpoints import write_qwen2_5_vl

IMAGES = [image_bytes(60, 90, 1), image_bytes(300, 37, 2)]


def _chat(checkpoint: Path, **options) -> list[int]:
    llm = LLM(str(checkpoint), **options)
    try:
        content = [image_part(data_url(IMAGES[0])), {"type": "text", "text": "and"}, image_part(data_url(IMAGES[1]))]
        out = llm.chat([[{"role": "user", "content": content}]], SamplingParams(max_tokens=8, temperature=0,
                                                                               ignore_eos=True))
        return out[0].token_ids
    finally:
        llm.close()


def _check(checkpoint: Path) -> None:
    expected = _chat(checkpoint, device="cpu", dtype="float32")
    assert _chat(checkpoint, device="cuda", dtype="float32", attention_backend="torch_native") == expected
    assert _chat(checkpoint, device="cuda", dtype="bfloat16")[0] == expected[0]


@pytest.mark.gpu
def test_qwen2_5_vl_on_cuda_equals_the_cpu(tmp_path: Path) -> None:
    _check(write_qwen2_5_vl(tmp_path / "qwen-vl", text_config={
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1_000_000.0},
    }, vision_config={"out_hidden_size": 256}))


@pytest.mark.gpu
def test_gemma3_images_both_ways_on_cuda_equal_the_cpu(tmp_path: Path) -> None:
    from test_gemma3_vision import gemma3_vl_folder

    _check(gemma3_vl_folder(tmp_path, text_overrides={"head_dim": 64}))
