"""Gemma 3 (text) on a tiny random checkpoint: sliding layers (window 12,
shorter than most test prompts) around a global one, per-layer-type rope,
a softmax scale from query_pre_attn_scalar, (1 + w) norms with w far from
zero, soft-capped logits and Gemma's chat template. Greedy equals
transformers token for token through the offline API and over HTTP; chunked
prefill, prefix-cache hits and preemption give the same tokens; tp 2 equals
tp 1; the FlashInfer backend (the CPU fake, window_left per layer) equals
the torch one; older configs' rope and layer pattern are read as
transformers reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioserve import LLM
from aioserve.models.model_config import ModelConfig
from family_checks import check_chat_over_http, check_chunked_cached_preempted
from hf_reference import hf_encode
from test_greedy_matches_hf import PROMPTS, check_against_hf
from test_tp_offline import check_tp2_matches_tp1
from tiny_models import build_checkpoint

WINDOW = 12


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3") / "gemma3")


def test_greedy_matches_transformers(gemma3: Path) -> None:
    prompts = [hf_encode(gemma3, p) for p in PROMPTS]
    assert sum(len(p) > 2 * WINDOW for p in prompts) >= 2  # the window cuts into them
    llm = LLM(str(gemma3), page_size=4)
    try:
        config = llm.engine.model_config
        assert config.sliding_windows == [WINDOW, None, WINDOW]
        assert config.attention_scale == 24**-0.5
        check_against_hf(gemma3, llm, prompts)
    finally:
        llm.close()


def test_chunked_prefill_prefix_cache_and_preemption(gemma3: Path) -> None:
    check_chunked_cached_preempted(gemma3)


def test_chat_over_http_with_gemma_template(gemma3: Path) -> None:
    """A system message folded into the first user turn, an earlier model turn."""
    check_chat_over_http(gemma3, [
        {"role": "system", "content": "You tell stories about robots."},
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": "the robot read about the sea."},
        {"role": "user", "content": "And then?"},
    ])


def test_roles_that_do_not_alternate_are_a_400(gemma3: Path) -> None:
    """Gemma's template refuses them (raise_exception): a client error, not a 500."""
    import httpx
    from server_harness import start_server

    server = start_server(gemma3, "--page-size", "4")
    try:
        body = {"model": server.info()["model"], "max_tokens": 4,
                "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
        response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=30)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "alternate" in error["message"] and error["type"] == "invalid_request_error"
    finally:
        server.stop()


def test_tp2_equals_tp1(gemma3: Path) -> None:
    check_tp2_matches_tp1(gemma3)


def test_flashinfer_backend_honours_each_layers_window(tmp_path: Path) -> None:
    """The fake FlashInfer (its head dims only: 64) planned with the model's
    softmax scale, each layer running with its own window_left."""
    from test_flashinfer_backend import TEXTS, _run

    model = build_checkpoint("gemma3", tmp_path / "gemma3-64", overrides={"head_dim": 64})
    prompts = [hf_encode(model, t) for t in TEXTS]
    options = dict(page_size=4, max_prefill_tokens=16, dtype="float32")
    reference = _run(model, prompts, fake=False, graphs=False, **options)
    assert _run(model, prompts, fake=True, graphs=False, **options) == reference


def test_older_config_form() -> None:
    """Hub configs written before transformers 5: rope_theta and rope_scaling
    for the global layers, rope_local_base_freq for the sliding ones, every
    sliding_window_pattern-th layer global."""
    raw = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
    }
    config = ModelConfig.from_dict(raw)
    assert config.sliding_windows == [512] * 5 + [None] + [512] * 2
    assert (config.rope_theta, config.rope_scaling.rope_type, config.rope_scaling.params) == (1e6, "linear", {"factor": 8.0})
    assert config.local_rope is not None
    theta, scaling = config.local_rope
    assert (theta, scaling.rope_type) == (10000.0, "default")
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_dict({**raw, "attn_logit_softcapping": 50.0})


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import build_gemma3_multimodal

    return build_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-mm") / "gemma3-mm")


def test_wrapped_text_model_matches_transformers(gemma3_multimodal: Path) -> None:
    """Gemma 3 4B-27B's layout (Gemma3ForConditionalGeneration): its text
    model read from the wrapper's config and tensors (the tower beside it:
    tests/test_gemma3_vision.py); greedy equals transformers' wrapper given
    text only, offline and through the chat template over HTTP."""
    from aioserve.models.text_of_multimodal import text_weight_name

    prompts = [hf_encode(gemma3_multimodal, p) for p in PROMPTS]
    llm = LLM(str(gemma3_multimodal), page_size=4)
    try:
        config = llm.engine.model_config
        assert (config.architecture, config.wrapper) == ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
        assert config.sliding_windows == [WINDOW, None, WINDOW]
        assert type(llm.engine.model).__name__ == "Gemma3ForConditionalGeneration"
        check_against_hf(gemma3_multimodal, llm, prompts)
    finally:
        llm.close()
    assert text_weight_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_weight_name("model.vision_tower.vision_model.embeddings.patch_embedding.weight") is None
    check_chat_over_http(gemma3_multimodal, [{"role": "user", "content": "Once upon a time"}])


def test_hub_wrapper_config_takes_text_defaults() -> None:
    """Gemma 3 4B's config.json as published: its text_config lists only what
    differs from Gemma3TextConfig's defaults; the EOS ids and dtype sit at the top."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
        "eos_token_id": [1, 106], "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "patch_size": 14},
    }
    config = ModelConfig.from_dict(raw)
    assert (config.architecture, config.wrapper) == ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (8, 4, 256, 262208)
    assert config.attention_scale == 256**-0.5 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.sliding_windows == ([1024] * 5 + [None]) * 5 + [1024] * 4
    assert (config.rope_theta, config.rope_scaling.rope_type) == (1e6, "linear")
    assert config.local_rope is not None and config.local_rope[0] == 10000.0
    assert config.eos_token_ids == [1, 106] and config.torch_dtype == "bfloat16"
    with pytest.raises(ValueError, match="text_config names no model_type"):
        ModelConfig.from_dict({**raw, "text_config": {"hidden_size": 2560}})


def test_config_and_tokenizer_take_turns_in_transformers(gemma3_multimodal: Path) -> None:
    """The server reads a wrapped model's config on the engine's thread while
    the tokenizer loads on another; both reach into transformers, whose lazy
    package two threads must not import at once (it once gave "cannot import
    name ... from partially initialized module"). Both wait for the lock."""
    import json
    import threading

    from aioserve.hf_imports import HF_IMPORT_LOCK
    from aioserve.models.text_of_multimodal import text_model_config
    from aioserve.tokenizer import load_hf_tokenizer

    raw = json.loads((gemma3_multimodal / "config.json").read_text())
    for call in (lambda: text_model_config(raw), lambda: load_hf_tokenizer(gemma3_multimodal)):
        done = threading.Event()
        with HF_IMPORT_LOCK:
            worker = threading.Thread(target=lambda: (call(), done.set()))
            worker.start()
            assert not done.wait(0.5)  # held up by the lock
        worker.join(timeout=60)
        assert done.is_set()
