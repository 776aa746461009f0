"""Rerankers (issue 41): a BERT cross-encoder (ms-marco MiniLM's layout)
and an XLM-R one (bge-reranker's) against sentence-transformers'
CrossEncoder.predict in float32, a causal LM scored by two tokens against
Qwen3-Reranker's model-card recipe; through the Python API, /v1/rerank and /rerank (Jina's and Cohere's shapes: strings or
{"text": ...} documents, top_n, return_documents) and /v1/score (one to one,
one to many); bad input is a clear 400 and every page comes back."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from aioserve import LLM
from conftest import assert_kv_intact
from pooling_checkpoints import bert_cross_encoder
from server_harness import start_server

pytest.importorskip("sentence_transformers")
from sentence_transformers import CrossEncoder  # noqa: E402

QUERY = "what is the cat"
DOCUMENTS = ["the cat sat on the mat", "a dog ran far away", "what is where", "x", "the cat is the cat"]
TOL = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bert_cross_encoder(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def expected(folder: Path) -> list[float]:
    return [float(s) for s in CrossEncoder(str(folder)).predict([(QUERY, d) for d in DOCUMENTS])]


@pytest.fixture(scope="module")
def server(folder: Path):
    running = start_server(folder, "--dtype", "float32", "--debug-integrity")
    yield running
    running.stop()


def test_python_api_scores_equal_cross_encoder(folder: Path, expected: list[float]) -> None:
    llm = LLM(str(folder), dtype="float32", page_size=4)
    try:
        got = llm.score(QUERY, DOCUMENTS)
        alone = [llm.score(QUERY, d)[0] for d in DOCUMENTS]
    finally:
        llm.close()
    assert got == pytest.approx(expected, abs=TOL)
    assert alone == pytest.approx(got, abs=1e-6)


def test_xlmr_cross_encoder_equals_cross_encoder(tmp_path: Path) -> None:
    """bge-reranker's layout: XLM-R's pair template (<s> A </s></s> B </s>), one token type."""
    from pooling_checkpoints import xlmr_cross_encoder

    folder = xlmr_cross_encoder(tmp_path)
    reference = [float(s) for s in CrossEncoder(str(folder)).predict([(QUERY, d) for d in DOCUMENTS])]
    llm = LLM(str(folder), dtype="float32", page_size=4)
    try:
        assert llm.score(QUERY, DOCUMENTS) == pytest.approx(reference, abs=TOL)
    finally:
        llm.close()


def test_rerank_sorts_by_relevance(server, expected: list[float]) -> None:
    response = httpx.post(f"{server.v1}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=TOL)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert body["usage"]["total_tokens"] > len(DOCUMENTS) and body["id"].startswith("rerank")
    assert_kv_intact(server)


def test_cohere_shape_top_n_and_no_documents_back(server, expected: list[float]) -> None:
    """Cohere's client sends documents as {"text": ...} objects, asks top_n,
    and may leave the documents out of the answer."""
    body = {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2, "return_documents": False}
    results = httpx.post(f"{server.url}/rerank", json=body, timeout=60).json()["results"]
    best = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)[:2]
    assert [r["index"] for r in results] == best and all("document" not in r for r in results)


def test_score_one_to_one_and_one_to_many(server, expected: list[float]) -> None:
    many = httpx.post(f"{server.v1}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    assert [d["score"] for d in many["data"]] == pytest.approx(expected, abs=TOL)
    pairs = {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}
    one_to_one = httpx.post(f"{server.url}/score", json=pairs, timeout=60).json()
    assert [d["score"] for d in one_to_one["data"]] == pytest.approx(expected[:2], abs=TOL)
    assert one_to_one["object"] == "list" and one_to_one["data"][0]["object"] == "score"


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": [""]}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 3000}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["the cat " * 40]}, "documents"),  # past 64 positions
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b"]}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/embeddings", {"input": "a"}, None),  # a reranker does not embed
])
def test_bad_input_is_a_clear_400(server, route: str, body: dict, param: str | None) -> None:
    response = httpx.post(f"{server.url}{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param or error["param"].startswith(f"{param}.")  # documents.0: the one at fault
    assert_kv_intact(server)


def test_tensor_parallel_pooling_equals_one_rank(folder: Path, expected: list[float], tmp_path: Path) -> None:
    """At tp 2 (one follower process) a cross-encoder scores and a BERT
    embedder embeds as one rank does: the encoder's projections shard like a
    decoder's, and the plan carries the pooling rows to every rank."""
    from pooling_checkpoints import bert_embedder

    llm = LLM(str(folder), dtype="float32", page_size=4, tp=2)
    try:
        assert llm.score(QUERY, DOCUMENTS) == pytest.approx(expected, abs=TOL)
    finally:
        llm.close()
    embedder = bert_embedder(tmp_path, "mean")
    vectors = {}
    for tp in (1, 2):
        llm = LLM(str(embedder), dtype="float32", page_size=4, tp=tp)
        try:
            vectors[tp] = torch.tensor([o.embedding for o in llm.embed(DOCUMENTS)])
        finally:
            llm.close()
    assert torch.allclose(vectors[1], vectors[2], atol=1e-5)


def test_a_causal_lm_reranks_by_two_tokens(tmp_path: Path) -> None:
    """Qwen3-Reranker's recipe (its model card): the published prompt, then
    softmax over the "no" and "yes" logits at the last position; here on a
    tiny Qwen3 with two of its own tokens standing for them, over HTTP and the
    Python API alike."""
    import json

    import transformers

    from aioserve.pooling_config import DEFAULT_INSTRUCTION, QWEN3_RERANKER_TEMPLATE
    from tiny_models import build_checkpoint

    folder = build_checkpoint("qwen3", tmp_path / "qwen3-reranker")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    no, yes = tokenizer.convert_ids_to_tokens([70, 80])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def card_score(document: str) -> float:
        text = (QWEN3_RERANKER_TEMPLATE.replace("{instruction}", DEFAULT_INSTRUCTION)
                .replace("{query}", QUERY).replace("{document}", document))
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(ids).logits[0, -1]
        return float(torch.softmax(last[[70, 80]], dim=-1)[1])

    expected = [card_score(d) for d in DOCUMENTS]
    spec = json.dumps({"classifier_from_token": [no, yes]})
    llm = LLM(str(folder), dtype="float32", page_size=4, max_prefill_tokens=32, pooler_config=json.loads(spec))
    try:
        assert llm.score(QUERY, DOCUMENTS) == pytest.approx(expected, abs=TOL)
    finally:
        llm.close()
    running = start_server(folder, "--dtype", "float32", "--pooler-config", spec)
    try:
        results = httpx.post(f"{running.v1}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
        assert {r["index"]: r["relevance_score"] for r in results["results"]} == pytest.approx(
            dict(enumerate(expected)), abs=TOL)
        assert_kv_intact(running)
    finally:
        running.stop()
