"""Gemma 3 4B-27B served whole (Gemma3ForConditionalGeneration): the SigLIP
tower and the pooling projector equal transformers', and a prompt with
images gives transformers' greedy tokens, its image tokens attending to each
other both ways, through chunked prefill (which never cuts an image) and a
prefix-cache hit on a repeated image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

from aioserve import LLM, SamplingParams
from aioserve.image_inputs import ImageSpan, ProcessedImage, PromptImages, content_key
from tiny_models import build_gemma3_multimodal

TOKENS = 4  # per image: 4x4 patches pooled 2x2


IMAGE_SPECIALS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
# Gemma3ImageProcessor at the tiny tower's size (the published one: 896x896), pan-and-scan off.
PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor", "size": {"height": 56, "width": 56}, "do_pan_and_scan": False,
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "do_convert_rgb": True,
}


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma3_vl_folder(tmp_path_factory.mktemp("gemma3-vl"))


def gemma3_vl_folder(root: Path, text_overrides: dict | None = None) -> Path:
    """The tiny wrapper with a two-layer 56x56 tower, 4 tokens per image, and
    the image specials added to its tokenizer (in the embedding's spare rows)."""
    from tokenizers import Tokenizer

    folder = root / "gemma3-vl"
    probe = build_gemma3_multimodal(root / "probe")
    size = Tokenizer.from_file(str(probe / "tokenizer.json")).get_vocab_size()
    boi, soft, eoi = size, size + 1, size + 2
    build_gemma3_multimodal(
        folder, text_overrides=text_overrides, vision_overrides={"image_size": 56, "num_hidden_layers": 2},
        mm_tokens_per_image=TOKENS, image_token_index=soft, boi_token_index=boi, eoi_token_index=eoi,
    )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(list(IMAGE_SPECIALS))
    assert [tokenizer.token_to_id(t) for t in IMAGE_SPECIALS] == [boi, soft, eoi]
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return folder


def hf_model(folder: Path):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def pixels(seed: int, count: int = 1) -> torch.Tensor:
    return torch.randn(count, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def test_tower_and_projector_equal_transformers(gemma3_vl: Path) -> None:
    llm = LLM(str(gemma3_vl))
    try:
        model = llm.engine.model
        images = [{"pixel_values": pixels(1)}, {"pixel_values": pixels(2)}]
        ours = model.encode_images(images)
        reference = hf_model(gemma3_vl).model.get_image_features(torch.cat([pixels(1), pixels(2)])).pooler_output
        assert [o.shape for o in ours] == [(TOKENS, 64)] * 2
        torch.testing.assert_close(torch.stack(ours), reference, atol=1e-5, rtol=1e-5)
    finally:
        llm.close()


def prompt(config: dict, seeds: list[int], text: int = 5) -> tuple[list[int], PromptImages, torch.Tensor]:
    """Text, then per image <start_of_image>, its soft tokens, <end_of_image>, text."""
    ids: list[int] = list(range(10, 10 + text))
    spans = []
    for seed in seeds:
        ids.append(config["boi_token_index"])
        tensors = {"pixel_values": pixels(seed)}
        image = ProcessedImage(content_key(tensors), tensors, TOKENS)
        spans.append(ImageSpan(image, len(ids), bidirectional=True))
        ids += [config["image_token_index"]] * TOKENS + [config["eoi_token_index"]]
        ids += list(range(20 + seed, 20 + seed + text))
    return ids, PromptImages(spans), torch.cat([pixels(s) for s in seeds])


def hf_greedy(folder: Path, ids: list[int], pixel_values: torch.Tensor, image_id: int, steps: int):
    """transformers' greedy tokens and their logprobs."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model(folder).generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixel_values,
            token_type_ids=(input_ids == image_id).long(), max_new_tokens=steps, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, tokens)]
    return tokens, logprobs


def run(llm: LLM, prompts: list[tuple[list[int], PromptImages]], steps: int):
    """Each prompt's greedy tokens and their logprobs (the offline API, images set on its requests)."""
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=0)
    outputs, requests = llm._prepare([ids for ids, _ in prompts], [params] * len(prompts), tqdm(disable=True))
    for request, (_, images) in zip(requests, prompts):
        request.images = images
    llm._run_requests(requests, tqdm(disable=True))
    return [(o.token_ids, o.logprobs) for o in outputs]


def assert_same(ours, expected) -> None:
    assert ours[0] == expected[0]
    torch.testing.assert_close(torch.tensor(ours[1]), torch.tensor(expected[1]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_prefill_tokens", [None, 9])
def test_images_attend_both_ways_as_transformers(gemma3_vl: Path, max_prefill_tokens: int | None) -> None:
    """Two images, one prompt; and the same image again (a prefix-cache hit).
    With chunks of 9 the boundary would fall inside the images: the planner
    stops before each and takes it whole."""
    config = json.loads((gemma3_vl / "config.json").read_text())
    ids, images, pixel_values = prompt(config, [1, 2])
    expected = hf_greedy(gemma3_vl, ids, pixel_values, config["image_token_index"], 8)
    options = {"max_prefill_tokens": max_prefill_tokens} if max_prefill_tokens else {}
    llm = LLM(str(gemma3_vl), page_size=4, **options)
    try:
        assert_same(run(llm, [(ids, images)], 8)[0], expected)
        again = run(llm, [(ids, prompt(config, [1, 2])[1])], 8)[0]  # the same images: their KV is cached
        assert_same(again, expected)
        assert llm.scheduler.table.stats.cached_tokens >= 12
        assert len(llm.scheduler.table.images) == 0 and llm.engine.images is not None
    finally:
        llm.close()
    # the both-ways mask matters: without it the logprobs differ
    causal = PromptImages([ImageSpan(s.image, s.offset) for s in images.spans])
    llm = LLM(str(gemma3_vl), page_size=4)
    try:
        assert abs(run(llm, [(ids, causal)], 8)[0][1][0] - expected[1][0]) > 1e-3
    finally:
        llm.close()


def test_chat_with_images_over_http_equals_transformers(gemma3_vl: Path) -> None:
    """Gemma's chat template writes <start_of_image>; the image's run is
    written into the text as transformers' processor writes it (its blank
    lines merging with the template's newlines), then tokenized."""
    import httpx
    from transformers import AutoTokenizer

    from image_fixtures import data_url, image_bytes, image_part
    from server_harness import start_server
    from vision_reference import reference

    images = [image_bytes(80, 50, 1), image_bytes(40, 120, 2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    ids, tokens = reference(gemma3_vl, messages, images, 6)
    text = AutoTokenizer.from_pretrained(gemma3_vl).decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    server = start_server(gemma3_vl, "--dtype", "float32", "--served-model-name", "g", "--max-prefill-tokens", "16")
    try:
        content = [image_part(data_url(images[0])), {"type": "text", "text": "and"}, image_part(data_url(images[1]))]
        body = {"model": "g", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": content}]}
        tokenized = httpx.post(f"{server.url}/tokenize", json={"model": "g", "messages": body["messages"]}, timeout=60)
        assert tokenized.json()["tokens"] == ids
        response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(ids)
        assert response.json()["choices"][0]["message"]["content"].rstrip("\ufffd") == text
    finally:
        server.stop()


def test_pan_and_scan_is_turned_off() -> None:
    """A processor that would cut a large image into extra crops (each 256
    tokens more than the prompt was laid out for) is set to one crop."""
    from types import SimpleNamespace

    from aioserve.images.family import ImageTokens
    from aioserve.images.gemma3_vl import Gemma3Vision

    processor = SimpleNamespace(do_pan_and_scan=True)
    Gemma3Vision(ImageTokens(1, 2, (1,), (3,)), TOKENS).configure_processor(processor)
    assert processor.do_pan_and_scan is False
