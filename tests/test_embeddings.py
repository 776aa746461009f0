"""Embedding models (issue 41), against sentence-transformers in float32:
a Qwen3 decoder with last-token pooling (Qwen3-Embedding's layout), BERT
encoders with mean and [CLS] pooling (all-MiniLM's, BGE's) and an XLM-R
one with mean pooling (multilingual-e5's), through the
Python API and over HTTP (the openai client, float and base64, token-id
inputs, langchain's OpenAIEmbeddings, litellm), batched and chunked alike; bad input
is a clear 400 and leaves every page free; a generating model refuses the
route and a pooling one the generating routes."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch

from aioserve import LLM, SamplingParams
from conftest import assert_kv_intact
from pooling_checkpoints import bert_embedder, qwen3_embedder, xlmr_embedder
from server_harness import start_server

pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402

TEXTS = ["the cat sat on the mat", "a dog ran far away", "what is where", "x",
         "the dog sat on the cat and the cat ran far away from the mat"]
MIN_COSINE = 0.99999


def served(server) -> str:
    return httpx.get(f"{server.v1}/models", timeout=30).json()["data"][0]["id"]


def cosines(got: list[list[float]], expected: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), expected.float())


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedders")
    return {"qwen3": qwen3_embedder(root), "bert-mean": bert_embedder(root, "mean"),
            "bert-cls": bert_embedder(root, "cls"), "xlmr-mean": xlmr_embedder(root)}


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> dict[str, torch.Tensor]:
    return {name: SentenceTransformer(str(folder)).encode(TEXTS, convert_to_tensor=True)
            for name, folder in folders.items()}


@pytest.mark.parametrize("name", ["qwen3", "bert-mean", "bert-cls", "xlmr-mean"])
def test_python_api_equals_sentence_transformers(folders, reference, name: str) -> None:
    """Chunked where the model allows it (a decoder's prompt in 5-token
    chunks: the last-token row comes from the final one), whole for an encoder."""
    llm = LLM(str(folders[name]), dtype="float32", page_size=4, max_prefill_tokens=5, debug_integrity=True)
    try:
        assert llm.engine.pooler is not None and llm.engine.pooler.normalize
        together = [o.embedding for o in llm.embed(TEXTS)]
        alone = [llm.embed(text)[0].embedding for text in TEXTS]
        llm.scheduler.check_integrity()
    finally:
        llm.close()
    assert cosines(together, reference[name]).min() >= MIN_COSINE
    # Batching and padding do not change a vector.
    assert torch.allclose(torch.tensor(together), torch.tensor(alone), atol=1e-5)


def test_a_prompt_only_request_whose_chunk_leaves_one_token_finishes(tmp_path: Path) -> None:
    """A chunk that stops one token short of a max_tokens-0 prompt used to
    leave that token to a decode that never came: the request hung."""
    from tiny_models import build_checkpoint

    model = build_checkpoint("qwen3", tmp_path / "qwen3")
    llm = LLM(str(model), dtype="float32", page_size=4, max_prefill_tokens=5)
    try:
        out = llm.generate([list(range(10, 16))], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    finally:
        llm.close()
    assert out.token_ids == [] and out.prompt_logprobs is not None and len(out.prompt_logprobs) == 6


@pytest.fixture(scope="module")
def qwen3_server(folders):
    # Matryoshka by flag (vLLM reads is_matryoshka from the config), chunked prefill.
    server = start_server(folders["qwen3"], "--dtype", "float32", "--max-prefill-tokens", "8",
                          "--pooler-config", '{"is_matryoshka": true}', "--debug-integrity")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bert_server(folders):
    server = start_server(folders["bert-mean"], "--dtype", "float32", "--debug-integrity")
    yield server
    server.stop()


def test_openai_client_float_and_base64(qwen3_server, reference) -> None:
    client = openai.OpenAI(base_url=qwen3_server.v1, api_key="none")
    floats = client.embeddings.create(model=served(qwen3_server), input=TEXTS)
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert cosines([d.embedding for d in floats.data], reference["qwen3"]).min() >= MIN_COSINE
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    raw = httpx.post(f"{qwen3_server.v1}/embeddings", json={"input": TEXTS, "encoding_format": "base64"}, timeout=60)
    assert raw.status_code == 200
    decoded = [list(struct.unpack(f"<{len(b) // 4}f", b)) for b in
               (base64.b64decode(d["embedding"]) for d in raw.json()["data"])]
    assert torch.allclose(torch.tensor(decoded), torch.tensor([d.embedding for d in floats.data]), atol=1e-6)
    # The openai client asks for base64 by default and decodes it itself.
    assert len(client.embeddings.create(model=served(qwen3_server), input="x").data[0].embedding) == 64
    assert_kv_intact(qwen3_server)


def test_token_id_inputs_equal_their_text(qwen3_server, folders) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folders["qwen3"]))
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    by_text = httpx.post(f"{qwen3_server.v1}/embeddings", json={"input": TEXTS[:2]}, timeout=60).json()
    by_ids = httpx.post(f"{qwen3_server.v1}/embeddings", json={"input": ids}, timeout=60).json()
    one = httpx.post(f"{qwen3_server.v1}/embeddings", json={"input": ids[0]}, timeout=60).json()
    vectors = [d["embedding"] for d in by_text["data"]]
    assert torch.allclose(torch.tensor([d["embedding"] for d in by_ids["data"]]), torch.tensor(vectors), atol=1e-6)
    assert torch.allclose(torch.tensor(one["data"][0]["embedding"]), torch.tensor(vectors[0]), atol=1e-6)


def test_matryoshka_dimensions_truncate_and_renormalise(qwen3_server, reference) -> None:
    body = httpx.post(f"{qwen3_server.v1}/embeddings", json={"input": TEXTS, "dimensions": 16}, timeout=60).json()
    got = torch.tensor([d["embedding"] for d in body["data"]])
    expected = torch.nn.functional.normalize(reference["qwen3"][:, :16].float(), dim=-1)
    assert got.shape == (len(TEXTS), 16) and torch.allclose(got, expected, atol=1e-5)
    too_many = httpx.post(f"{qwen3_server.v1}/embeddings", json={"input": "x", "dimensions": 65}, timeout=30)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "dimensions"


def test_bert_over_http_and_langchain(bert_server, reference) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=served(bert_server), base_url=bert_server.v1, api_key="none",
                                  check_embedding_ctx_length=False)
    got = embeddings.embed_documents(TEXTS)
    assert cosines(got, reference["bert-mean"]).min() >= MIN_COSINE
    assert cosines([embeddings.embed_query(TEXTS[0])], reference["bert-mean"][:1]).min() >= MIN_COSINE


def test_litellm_embedding(bert_server, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm's OpenAI-compatible provider (`openai/<name>` at our base URL)."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its import would fetch a price list: no network here
    litellm = pytest.importorskip("litellm")
    response = litellm.embedding(model=f"openai/{served(bert_server)}", api_base=bert_server.v1, api_key="none",
                                 input=TEXTS)
    assert cosines([item["embedding"] for item in response.data], reference["bert-mean"]).min() >= MIN_COSINE


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["x"] * 3000}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "the cat " * 40}, "input"),  # past BERT's 64 positions
    ({"input": 5}, "input"),
])
def test_bad_input_is_a_clear_400(bert_server, body: dict, param: str) -> None:
    response = httpx.post(f"{bert_server.v1}/embeddings", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert httpx.get(f"{bert_server.url}/health", timeout=5).status_code == 200
    assert_kv_intact(bert_server)


def test_truncation_keeps_the_last_tokens(bert_server) -> None:
    long = "the cat " * 40
    response = httpx.post(f"{bert_server.v1}/embeddings", json={"input": long, "truncate_prompt_tokens": 32}, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 32


def test_the_kinds_refuse_each_other(bert_server, stories_server) -> None:
    chat = httpx.post(f"{bert_server.v1}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=30)
    assert chat.status_code == 400 and "pooling model" in chat.json()["error"]["message"]
    completion = httpx.post(f"{bert_server.v1}/completions", json={"prompt": "hi"}, timeout=30)
    assert completion.status_code == 400
    rerank = httpx.post(f"{bert_server.v1}/rerank", json={"query": "a", "documents": ["b"]}, timeout=30)
    assert rerank.status_code == 400 and "/v1/embeddings" in rerank.json()["error"]["message"]
    embed = httpx.post(f"{stories_server.v1}/embeddings", json={"input": "hi"}, timeout=30)
    assert embed.status_code == 400 and "--runner pooling" in embed.json()["error"]["message"]
    assert httpx.get(f"{bert_server.url}/health_generate", timeout=30).status_code == 200
    tokens = httpx.post(f"{bert_server.url}/tokenize", json={"prompt": "the cat"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["tokens"][0] == 2  # [CLS]: as the model will see it


def test_metrics_count_pooling_by_endpoint(bert_server) -> None:
    httpx.post(f"{bert_server.v1}/embeddings", json={"input": ["a b", "c"]}, timeout=30).raise_for_status()
    text = httpx.get(f"{bert_server.url}/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("aioserve:pooling_inputs_total")]
    assert lines and 'endpoint="embeddings"' in lines[0] and float(lines[0].split()[-1]) >= 2

