"""Qwen2.5-VL on a tiny random checkpoint (tests/vision_checkpoints.py),
against transformers in float32 on the CPU: the vision tower's embeddings
(window attention that splits the images, several images of different
sizes in one pass), the M-RoPE rotary, M-RoPE positions, text-only greedy
through the offline API, and a prompt with two images through the decoder
(a prefill with [3, L] positions and the images' rows, then decodes at
their KV index plus the delta, on the fast paths)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aioserve import LLM
from aioserve.batch_plan import BatchPlan
from aioserve.config import EngineConfig
from aioserve.engine.engine import Engine
from aioserve.image_inputs import ImageSpan, ProcessedImage, content_key, mrope_positions
from aioserve.layers.rotary import RopeScaling, RotaryEmbedding
from aioserve.models.causal_lm import vision_language
from aioserve.models.model_config import ModelConfig
from aioserve.models.vision_layout import image_batch_layout
from hf_reference import hf_encode, hf_greedy
from test_greedy_matches_hf import PROMPTS
from vision_checkpoints import write_qwen2_5_vl

# (height, width) in pixels: a square, a 37 x 300 strip (one row of merge
# blocks, cut into windows), a tall one.
IMAGE_SIZES = [(100, 120), (37, 300), (200, 150)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def processed(checkpoint: Path, sizes: list[tuple[int, int]], seed: int = 0) -> list[ProcessedImage]:
    """Random images through the checkpoint's own image processor."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(checkpoint)
    rng = np.random.default_rng(seed)
    images = []
    for height, width in sizes:
        pixels = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        out = processor(images=[pixels], return_tensors="pt")
        tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        t, h, w = out["image_grid_thw"][0].tolist()
        images.append(ProcessedImage(content_key(tensors), tensors, t * h * w // 4, (t, h // 2, w // 2)))
    return images


def hf_inputs(images: list[ProcessedImage]) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.cat([i.tensors["pixel_values"] for i in images]),
        "image_grid_thw": torch.cat([i.tensors["image_grid_thw"] for i in images]),
    }


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), page_size=4))


def test_config_reads_the_vision_side(checkpoint: Path) -> None:
    from tokenizers import Tokenizer

    config = ModelConfig.from_path(checkpoint)
    vocab = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert config.architecture == "Qwen2_5_VLForConditionalGeneration" and config.uses_mrope
    assert config.vision is not None
    assert config.vision.image_token_id == vocab.token_to_id("<|image_pad|>")
    assert config.vision.vision_start_token_id == vocab.token_to_id("<|vision_start|>")
    assert config.vision.vision_end_token_id == vocab.token_to_id("<|vision_end|>")
    assert (config.vision.mrope_section, config.vision.spatial_merge_size) == ((2, 3, 3), 2)
    assert config.eos_token_ids == [vocab.token_to_id("<|im_end|>"), vocab.token_to_id("<|endoftext|>")]
    assert (config.hidden_size, config.num_layers, config.num_kv_heads, config.vocab_size) == (64, 2, 2, vocab.get_vocab_size() + 8)


def test_published_config_form() -> None:
    """Qwen2.5-VL-3B-Instruct's config.json as published (transformers 4):
    text fields at the top level, rope_scaling of type "mrope"."""
    raw = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "bos_token_id": 151643,
        "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
        "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936,
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    }
    config = ModelConfig.from_dict(raw)
    assert (config.rope_theta, config.rope_scaling) == (1e6, RopeScaling("default", {}, (16, 24, 24)))
    assert (config.head_dim, config.sliding_windows, config.tie_word_embeddings) == (128, [None] * 36, True)
    assert config.vision is not None and config.vision.image_token_id == 151655
    from aioserve.models.qwen2_5_vision import VisionTowerConfig

    tower = VisionTowerConfig.from_dict(config.vision.raw)
    assert (tower.in_channels, tower.window_blocks, tower.head_dim, tower.rope_theta) == (3, 4, 80, 10000.0)
    # A text model's config keeps plain rope.
    assert not ModelConfig.from_dict({**raw, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None}).uses_mrope


def test_mrope_rotary_matches_transformers() -> None:
    """[3, T] positions rotate as Qwen2_5_VLRotaryEmbedding's cos/sin do;
    with the three axes equal, as the 1-D rotary (the native kernel's path)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

    head_dim, section = 128, (16, 24, 24)
    hf_config = Qwen2_5_VLTextConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=2048,
                                     rope_parameters={"rope_type": "default", "mrope_section": list(section),
                                                      "rope_theta": 1e6})
    ours = RotaryEmbedding(head_dim, 2048, 1e6, RopeScaling("default", {}, section))
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 2000, (3, 37), generator=generator)
    q = torch.randn(37, 4, head_dim, generator=generator)
    k = torch.randn(37, 2, head_dim, generator=generator)
    cos, sin = Qwen2_5_VLRotaryEmbedding(hf_config)(q, positions[:, None, :])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q.clone(), k.clone())
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    ours.new_step()
    flat = positions[1]
    equal_q, equal_k = ours(flat.expand(3, -1), q.clone(), k.clone())
    plain_q, plain_k = ours(flat, q.clone(), k.clone())
    torch.testing.assert_close(equal_q, plain_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(equal_k, plain_k, atol=1e-5, rtol=1e-5)


def test_encode_images_matches_transformers(checkpoint: Path, hf: Any, engine: Engine) -> None:
    """One image alone, then three of different sizes in one tower pass:
    each image's rows equal transformers' get_image_features."""
    model = vision_language(engine.model)
    assert model is not None
    images = processed(checkpoint, IMAGE_SIZES)
    grids = [i.tensors["image_grid_thw"][0].tolist() for i in images]
    assert grids == [[1, 8, 8], [1, 2, 22], [1, 14, 10]]
    # Windows of 2 x 2 merge blocks cut them into 4, 6 (a 1 x 11 row) and 12 (7 x 5, uneven) windows.
    layout = image_batch_layout([[tuple(g)] for g in grids], 2, 2, torch.device("cpu"))
    assert sum(rows.shape[0] for rows in layout.windows.groups) == 4 + 6 + 12
    assert sum(rows.shape[0] for rows in layout.full.groups) == 3
    with torch.no_grad():
        expected = hf.model.get_image_features(**hf_inputs(images)).pooler_output
        alone = model.encode_images([images[0].tensors])
        together = model.encode_images([i.tensors for i in images])
    assert len(alone) == 1 and len(together) == 3
    torch.testing.assert_close(alone[0], expected[0], atol=1e-5, rtol=1e-5)
    for got, want, image in zip(together, expected, images):
        assert got.shape == (image.num_tokens, 64) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def two_image_prompt(checkpoint: Path, images: list[ProcessedImage]) -> tuple[list[int], list[ImageSpan]]:
    """A chat prompt through the checkpoint's template: an image, text, an
    image, text; each <|image_pad|> widened to its image's tokens."""
    from hf_reference import hf_tokenizer

    tokenizer = hf_tokenizer(str(checkpoint))
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a"}}, {"type": "text", "text": "Once upon a time"},
        {"type": "image"}, {"type": "text", "text": "the robot read about the sea."},
    ]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids: list[int] = []
    spans: list[ImageSpan] = []
    pending = iter(images)
    for token in tokenizer(text).input_ids:
        if token == pad:
            image = next(pending)
            spans.append(ImageSpan(image, len(ids)))
            ids += [pad] * image.num_tokens
        else:
            ids.append(token)
    return ids, spans


def test_mrope_positions_match_get_rope_index(checkpoint: Path, hf: Any) -> None:
    images = processed(checkpoint, IMAGE_SIZES[:2])
    ids, spans = two_image_prompt(checkpoint, images)
    positions, delta = mrope_positions(len(ids), spans)
    pad = hf.config.image_token_id
    input_ids = torch.tensor([ids])
    expected, deltas = hf.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == pad).int(), image_grid_thw=hf_inputs(images)["image_grid_thw"]
    )
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(deltas) and delta < 0


def _plan(ids: list[int], start: int, positions: torch.Tensor, pages: torch.Tensor, page_size: int) -> BatchPlan:
    """One request's step: tokens [start, start + len(ids)) over its pages."""
    count = len(ids)
    index = torch.arange(start, start + count)
    return BatchPlan(
        step=start, input_ids=torch.tensor(ids), positions=positions,
        out_cache_loc=pages[index // page_size] * page_size + index % page_size,
        seq_lens=torch.tensor([start + count]), extend_lens=torch.tensor([count]), page_table=pages[None].int(),
        num_decodes=1 if start and count == 1 else 0, logits_indices=torch.tensor([count - 1]), sampling=None,
    )


def test_prompt_with_images_matches_transformers(checkpoint: Path, hf: Any, engine: Engine) -> None:
    """A prefill of a two-image prompt ([3, L] positions, the images' rows
    from encode_images) gives transformers' last logits; decodes at their
    KV index plus the delta (1-D positions: the native decode path) go on
    to transformers' greedy tokens."""
    model = vision_language(engine.model)
    assert model is not None
    images = processed(checkpoint, IMAGE_SIZES[:2], seed=1)
    ids, spans = two_image_prompt(checkpoint, images)
    positions, delta = mrope_positions(len(ids), spans)
    pad = hf.config.image_token_id
    input_ids = torch.tensor([ids])
    inputs = dict(input_ids=input_ids, mm_token_type_ids=(input_ids == pad).int(), **hf_inputs(images))
    new_tokens = 6
    with torch.no_grad():
        expected_logits = hf(**inputs).logits[0, -1]
        expected = hf.generate(**inputs, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected_ids = expected[0, len(ids):].tolist()

    page_size = engine.page_size
    pages = torch.arange(1, 2 + (len(ids) + new_tokens) // page_size)  # page 0 is the pool's reserved one
    with torch.inference_mode():
        embeds = torch.cat(model.encode_images([span.image.tensors for span in spans]))
        rows = torch.cat([torch.arange(span.offset, span.end) for span in spans])
        plan = _plan(ids, 0, torch.arange(len(ids)), pages, page_size)
        hidden = model(plan.input_ids, positions, engine.attention.prepare(plan, plan), image_embeds=(rows, embeds))
        logits = model.compute_logits(hidden[-1:])[0]
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
        got = [int(logits.argmax())]
        for step in range(1, new_tokens):
            index = len(ids) + step - 1
            plan = _plan(got[-1:], index, torch.tensor([index + delta]), pages, page_size)
            hidden = model(plan.input_ids, plan.positions, engine.attention.prepare(plan, plan))
            got.append(int(model.compute_logits(hidden)[0].argmax()))
    assert got == expected_ids


def test_text_greedy_matches_transformers(checkpoint: Path, hf: Any) -> None:
    """Text only through the offline API (the native decode step serves the
    decodes) equals transformers' generate, token for token."""
    prompts = [hf_encode(checkpoint, p) for p in PROMPTS[:3]]
    llm = LLM(str(checkpoint), page_size=4)
    try:
        from aioserve import SamplingParams

        assert type(llm.engine.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
        for ids, out in zip(prompts, outputs):
            ref_ids, ref_logprobs = hf_greedy(checkpoint, ids, 12, model=hf)
            assert out.token_ids == ref_ids
            assert max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs)) < 1e-4
    finally:
        llm.close()


def test_transformers_5_weight_names_load(checkpoint: Path, tmp_path: Path) -> None:
    """The same tensors named as transformers 5 lays the model out
    (model.language_model.*, model.visual.*) load into the same weights."""
    from safetensors.torch import load_file, save_file

    from aioserve.models.weight_loader import build_model

    folder = tmp_path / "renamed"
    shutil.copytree(checkpoint, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {
        ("model.language_model." + name[len("model."):]) if name.startswith("model.")
        else ("model." + name) if name.startswith("visual.") else name: tensor
        for name, tensor in tensors.items()
    }
    assert any(name.startswith("model.visual.") for name in renamed)
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cpu = torch.device("cpu")
    # (built apart from an engine, whose CPU paths repack the matmul weights)
    reference = dict(build_model(ModelConfig.from_path(checkpoint), checkpoint, torch.float32, cpu, "auto", 0)
                     .named_parameters())  # type: ignore[attr-defined]
    loaded = dict(build_model(ModelConfig.from_path(folder), folder, torch.float32, cpu, "auto", 0)
                  .named_parameters())  # type: ignore[attr-defined]
    assert loaded.keys() == reference.keys()
    for name, param in loaded.items():
        assert torch.equal(param, reference[name]), name


def test_tp2_equals_tp1_with_the_tower_replicated(checkpoint: Path, hf: Any) -> None:
    """Two ranks split the decoder and each hold the whole tower: text
    greedy as on one rank, and the leader's tower as transformers'."""
    from test_tp_offline import check_tp2_matches_tp1

    check_tp2_matches_tp1(checkpoint)
    images = processed(checkpoint, IMAGE_SIZES[1:])
    llm = LLM(str(checkpoint), page_size=4, tp=2)
    try:
        model = vision_language(llm.engine.model)
        assert model is not None
        with torch.no_grad():
            got = model.encode_images([i.tensors for i in images])
            expected = hf.model.get_image_features(**hf_inputs(images)).pooler_output
    finally:
        llm.close()
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_the_tower_computes_as_the_engine_does(checkpoint: Path) -> None:
    """bf16 weights on a CPU whose half math is float32 (no AVX512-BF16, no
    AMX): the tower is widened to float32 (a bf16 linear through torch ran
    4.6x slower there); where the CPU has the units it stays bf16. Its
    embeddings always come out in the decoder's embedding dtype."""
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="bfloat16", device="cpu"))
    tower = next(engine.model.visual.parameters()).dtype
    assert tower == (torch.float32 if engine.dtype == torch.float32 else torch.bfloat16)
    out = engine.model.encode_images([t.tensors for t in processed(checkpoint, [(56, 84)])])
    assert out[0].dtype == engine.model.embed_tokens.weight.dtype
