"""Images over HTTP on a tiny Qwen2.5-VL: chat completions with image parts
give transformers' greedy text and its prompt length (one image, two of odd
sizes, an image amid long text, chunked prefill cutting the images), a
repeated image is served from the prefix cache (`cached_tokens`) and a
different one is not, text-only and image requests batch together, and the
openai client, langchain-openai and litellm send images as their users do;
/v1/tokenize, /v1/responses and /generate take them too; a broken image is
a 400 while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from image_fixtures import data_url, image_bytes, image_part
from server_harness import start_server
from vision_checkpoints import write_qwen2_5_vl
from vision_reference import reference

MAX_TOKENS = 10
IMAGES = {"square": image_bytes(60, 90, 1), "strip": image_bytes(300, 37, 2), "other": image_bytes(64, 64, 3)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_5_vl(tmp_path_factory.mktemp("qwen-vl") / "qwen-vl")


@pytest.fixture(scope="module")
def server(checkpoint: Path):
    # Chunks of 32 tokens cut through the images (4-64 tokens each).
    running = start_server(checkpoint, "--dtype", "float32", "--max-prefill-tokens", "32", "--debug-integrity",
                           "--served-model-name", "m")
    yield running
    running.stop()


def parts(*items: str) -> list[dict]:
    """OpenAI content parts: an IMAGES key is that image, anything else text."""
    return [image_part(data_url(IMAGES[i])) if i in IMAGES else {"type": "text", "text": i} for i in items]


def hf_parts(*items: str) -> list[dict]:
    return [{"type": "image"} if i in IMAGES else {"type": "text", "text": i} for i in items]


def expected(checkpoint: Path, *items: str) -> tuple[list[int], str]:
    from transformers import AutoTokenizer

    ids, tokens = reference(checkpoint, [{"role": "user", "content": hf_parts(*items)}],
                            [IMAGES[i] for i in items if i in IMAGES], MAX_TOKENS)
    # A random model's bytes may end mid-character: a stream holds those back, a whole decode shows U+FFFD.
    return ids, AutoTokenizer.from_pretrained(checkpoint).decode(tokens, skip_special_tokens=True).rstrip("\ufffd")


def chat(server: Any, *items: str) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": parts(*items)}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


CASES = {
    "one image": ("square", "What is in the picture?"),
    "two odd sizes": ("Compare", "square", "with", "strip"),
    "amid long text": ("a story " * 40, "strip", "and then " * 30),
}


@pytest.mark.parametrize("case", CASES)
def test_chat_with_images_equals_transformers(server: Any, checkpoint: Path, case: str) -> None:
    ids, text = expected(checkpoint, *CASES[case])
    out = chat(server, *CASES[case])
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"].rstrip("\ufffd") == text


def test_a_repeated_image_is_cached_and_another_is_not(server: Any, checkpoint: Path) -> None:
    first = chat(server, "Describe", "other", "in one word")
    again = chat(server, "Describe", "other", "in one word")
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= again["usage"]["prompt_tokens"] - 16  # all but the last page or so
    IMAGES["other-2"] = image_bytes(64, 64, 4)  # same size, other pixels: the same placeholder ids
    try:
        different = chat(server, "Describe", "other-2", "in one word")
    finally:
        ids, text = expected(checkpoint, "Describe", "other-2", "in one word")
        del IMAGES["other-2"]
    assert different["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]
    image_start = ids.index(json.loads((checkpoint / "config.json").read_text())["image_token_id"])
    assert different["usage"]["prompt_tokens_details"]["cached_tokens"] <= image_start  # the text before the image at most
    assert different["choices"][0]["message"]["content"].rstrip("\ufffd") == text


def test_text_and_image_requests_batch_together(server: Any, checkpoint: Path) -> None:
    cases = [("square", "What is this?"), ("Just text, please.",), ("strip",), ("Another text-only prompt",)]
    wanted = [expected(checkpoint, *c)[1] for c in cases]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(items: tuple[str, ...]) -> str:
                body = {"model": "m", "messages": [{"role": "user", "content": parts(*items)}],
                        "max_tokens": MAX_TOKENS, "temperature": 0}
                response = await client.post(f"{server.v1}/chat/completions", json=body)
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["message"]["content"].rstrip("\ufffd")

            return list(await asyncio.gather(*(one(c) for c in cases)))

    assert asyncio.run(run()) == wanted
    info = server.wait_idle(timeout=30)
    assert info["running"] == 0


def test_clients_send_images(server: Any, checkpoint: Path) -> None:
    """The openai client, langchain-openai and litellm, each with an image message."""
    _, text = expected(checkpoint, "square", "What is in the picture?")
    client = openai.OpenAI(base_url=server.v1, api_key="none")
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": parts("square", "What is in the picture?")}],  # type: ignore[misc]
        max_tokens=MAX_TOKENS, temperature=0,
    )
    assert (out.choices[0].message.content or "").rstrip("\ufffd") == text

    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=server.v1, api_key="none", model="m", max_tokens=MAX_TOKENS, temperature=0)
    answer = model.invoke([HumanMessage(content=parts("square", "What is in the picture?"))])
    assert str(answer.content).rstrip("\ufffd") == text

    import litellm

    reply = litellm.completion(model="openai/m", api_base=server.v1, api_key="none", max_tokens=MAX_TOKENS,
                               temperature=0, messages=[{"role": "user", "content": parts("square", "What is in the picture?")}])
    assert (reply.choices[0].message.content or "").rstrip("\ufffd") == text


def test_tokenize_responses_and_generate_take_images(server: Any, checkpoint: Path) -> None:
    ids, text = expected(checkpoint, "square", "What is in the picture?")
    tokenized = httpx.post(f"{server.url}/tokenize", json={
        "model": "m", "messages": [{"role": "user", "content": parts("square", "What is in the picture?")}],
    }, timeout=60).json()
    assert tokenized["count"] == len(ids) and tokenized["tokens"] == ids
    response = httpx.post(f"{server.v1}/responses", json={
        "model": "m", "max_output_tokens": MAX_TOKENS, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGES["square"])},
                                               {"type": "input_text", "text": "What is in the picture?"}]}],
    }, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"].rstrip("\ufffd") == text
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(checkpoint).decode(ids)
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    raw = prompt.replace("<|image_pad|>", "").replace("<|vision_start|><|vision_end|>", marker)
    generated = httpx.post(f"{server.url}/generate", json={
        "text": raw, "image_data": data_url(IMAGES["square"]),
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
    }, timeout=120)
    assert generated.status_code == 200, generated.text
    assert generated.json()["text"].rstrip("\ufffd") == text


def test_a_broken_image_is_a_400_and_the_server_serves_on(server: Any) -> None:
    truncated = image_bytes(64, 64, 5)[:200]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, image_part(data_url(truncated))]}]}
    response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1.image_url" and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/get_model_info", timeout=10).json()["has_image_understanding"] is True
    assert chat(server, "square", "still there?")["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.wait_idle(timeout=30)["running"] == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_chat_and_generate_take_images(checkpoint: Path, tp: int) -> None:
    """LLM.chat with image parts (a data URL, vLLM's image_pil), and vLLM's
    multi_modal_data beside a prompt holding the marker; under --tp 2 the
    plan carries the images to the follower, which encodes them too."""
    from transformers import AutoTokenizer

    from aioserve import LLM, SamplingParams
    from vision_reference import pil

    ids, text = expected(checkpoint, "square", "What is in the picture?", "strip")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    llm = LLM(str(checkpoint), dtype="float32", tp=tp, max_prefill_tokens=32)
    try:
        conversation = [{"role": "user", "content": [
            image_part(data_url(IMAGES["square"])), {"type": "text", "text": "What is in the picture?"},
            {"type": "image_pil", "image_pil": pil(IMAGES["strip"])},
        ]}]
        out = llm.chat([conversation], params)[0]
        assert out.prompt_token_ids == ids and out.text.rstrip("\ufffd") == text
        prompt = AutoTokenizer.from_pretrained(checkpoint).decode(ids).replace("<|image_pad|>", "")
        marker = "<|vision_start|><|vision_end|>"
        prompt = prompt.replace(marker, "<|vision_start|><|image_pad|><|vision_end|>")
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [pil(IMAGES["square"]), pil(IMAGES["strip"])]}},
                           params)[0]
        assert out.prompt_token_ids == ids and out.text.rstrip("\ufffd") == text
    finally:
        llm.close()
