"""SGLang's native POST /generate through the real server: the same tokens,
logprobs and stops as the OpenAI endpoints, in SGLang's shapes."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "Once upon a time"


# The stories server's KV pool is checked after every test (conftest.stories_kv_intact).
pytestmark = pytest.mark.usefixtures("stories_kv_intact")


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=60)


def completion(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


def test_text_prompt_matches_completions(stories_server) -> None:
    response = generate(stories_server, {"text": PROMPT, "sampling_params": greedy(8), "rid": "req-1"})
    assert response.status_code == 200, response.text
    out = response.json()
    reference = completion(stories_server, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    assert out["text"] == reference["choices"][0]["text"]
    prompt_ids = httpx.post(f"{stories_server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    decoded = httpx.post(f"{stories_server.url}/detokenize", json={"tokens": prompt_ids + out["output_ids"]}).json()
    assert decoded["prompt"] == PROMPT + out["text"]
    meta = out["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (5, 8)
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta  # only with return_logprob


def test_input_ids_batches_and_n(stories_server) -> None:
    ids = httpx.post(f"{stories_server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    single = generate(stories_server, {"input_ids": ids, "sampling_params": greedy(6)}).json()
    assert single["text"] == generate(stories_server, {"text": PROMPT, "sampling_params": greedy(6)}).json()["text"]
    batch = generate(stories_server, {"input_ids": [ids, ids[:3]], "sampling_params": greedy(6), "rid": ["a", "b"]}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["text"] == single["text"] and [o["meta_info"]["id"] for o in batch] == ["a", "b"]
    texts = generate(stories_server, {"text": [PROMPT, "The dog"], "sampling_params": greedy(4)}).json()
    dog = httpx.post(f"{stories_server.url}/tokenize", json={"prompt": "The dog"}).json()["count"]
    assert [o["meta_info"]["prompt_tokens"] for o in texts] == [5, dog]
    assert texts[0]["text"] == single["text"][: len(texts[0]["text"])]
    sampled = generate(
        stories_server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "n": 2, "sampling_seed": 7}}
    ).json()
    assert len(sampled) == 2 and sampled[0]["text"] != sampled[1]["text"]


def test_seed_names(stories_server) -> None:
    def text(**seed) -> str:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, **seed}}
        return generate(stories_server, body).json()["text"]

    assert text(sampling_seed=11) == text(seed=11) == text(sampling_seed=11)
    assert text(sampling_seed=11) != text(sampling_seed=12)


def test_streaming_sends_cumulative_text(stories_server) -> None:
    body = {"text": PROMPT, "sampling_params": greedy(10), "stream": True}
    response = generate(stories_server, body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    outputs = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    whole = generate(stories_server, {**body, "stream": False}).json()
    assert outputs[-1]["text"] == whole["text"] and outputs[-1]["output_ids"] == whole["output_ids"]
    assert all(whole["text"].startswith(o["text"]) for o in outputs)
    assert [len(o["output_ids"]) for o in outputs] == sorted(len(o["output_ids"]) for o in outputs)
    assert all(o["meta_info"]["finish_reason"] is None for o in outputs[:-1])
    assert outputs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert all("index" not in o for o in outputs)


def test_streamed_batch_events_carry_their_index(stories_server) -> None:
    body = {"text": [PROMPT, "The dog"], "sampling_params": greedy(5), "stream": True}
    events = [e for e in generate(stories_server, body).text.split("\n\n") if e][:-1]
    outputs = [json.loads(e.removeprefix("data: ")) for e in events]
    whole = generate(stories_server, {**body, "stream": False}).json()
    for index in (0, 1):
        mine = [o for o in outputs if o["index"] == index]
        assert mine[-1]["text"] == whole[index]["text"] and mine[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_logprobs_match_completions(stories_server) -> None:
    body = {
        "text": PROMPT, "sampling_params": greedy(6), "return_logprob": True, "top_logprobs_num": 2,
        "logprob_start_len": 0, "return_text_in_logprobs": True,
    }
    meta = generate(stories_server, body).json()["meta_info"]
    ref = completion(stories_server, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True)
    ref_lp = ref["choices"][0]["logprobs"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    assert [e[0] for e in entries][1:] == pytest.approx(ref_lp["token_logprobs"][1:], abs=1e-5)
    assert entries[0][0] is None and [e[2] for e in entries] == ref_lp["tokens"]
    assert len(meta["input_token_logprobs"]) == 5 and len(meta["output_token_logprobs"]) == 6
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["input_top_logprobs"][0] is None and all(len(top) == 2 for top in meta["input_top_logprobs"][1:])
    # Without logprob_start_len, no prompt logprobs; without return_text_in_logprobs, no texts.
    plain = generate(stories_server, {"text": PROMPT, "sampling_params": greedy(3), "return_logprob": True}).json()
    assert "input_token_logprobs" not in plain["meta_info"] and "output_top_logprobs" not in plain["meta_info"]
    assert [e[1] for e in plain["meta_info"]["output_token_logprobs"]] == plain["output_ids"]
    assert all(e[2] is None for e in plain["meta_info"]["output_token_logprobs"])
    # From position 3 on, as SGLang's logprob_start_len counts.
    tail = generate(stories_server, {**body, "logprob_start_len": 3}).json()["meta_info"]["input_token_logprobs"]
    assert tail == meta["input_token_logprobs"][3:]


def test_max_new_tokens_0_scores_the_prompt(stories_server) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
    out = generate(stories_server, body).json()
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["meta_info"]["input_token_logprobs"]) == 5


def test_stops_report_what_matched(stories_server) -> None:
    whole = generate(stories_server, {"text": PROMPT, "sampling_params": greedy(32)}).json()
    cut = whole["text"].index("l named L")
    by_string = generate(stories_server, {"text": PROMPT, "sampling_params": greedy(32, stop=["zzz", "l named L"])}).json()
    assert by_string["text"] == whole["text"][:cut]
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": "l named L"}
    kept = generate(stories_server, {"text": PROMPT, "sampling_params": greedy(32, stop="l named L", no_stop_trim=True)}).json()
    assert kept["text"] == whole["text"][: cut + len("l named L")]
    stop_id = whole["output_ids"][10]
    by_token = generate(stories_server, {"text": PROMPT, "sampling_params": greedy(32, stop_token_ids=[stop_id])}).json()
    assert by_token["output_ids"] == whole["output_ids"][: whole["output_ids"].index(stop_id) + 1]
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"sampling_params": greedy(4)}, "text"),
        ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": [1, 2, 99999]}, "input_ids"),
        ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        # The engine's ranges (aioserve/sampling_limits.py), declared by the request model.
        ({"text": PROMPT, "sampling_params": {"temperature": 100.5}}, "sampling_params.temperature"),
        ({"text": PROMPT, "sampling_params": {"presence_penalty": 2.5}}, "sampling_params.presence_penalty"),
        ({"text": PROMPT, "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 600}}, "sampling_params.max_new_tokens"),
        ({"text": PROMPT, "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "sampling_params.min_new_tokens"),
        ({"text": PROMPT, "sampling_params": {"stop_token_ids": [-3]}}, "sampling_params.stop_token_ids"),
        ({"text": PROMPT, "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
        ({"text": PROMPT, "sampling_params": {"regex": "[a-"}}, "sampling_params.regex"),
        # Checked before compiling, as the OpenAI routes check theirs (it was named structured_outputs.json).
        ({"text": PROMPT, "sampling_params": {"json_schema": '{"$ref": "https://example.com/s.json"}'}},
         "sampling_params.json_schema"),
        ({"text": PROMPT, "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
        ({"text": PROMPT, "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
        ({"text": [PROMPT, PROMPT], "rid": ["only-one"]}, "rid"),
    ],
)
def test_bad_requests(stories_server, body, param) -> None:
    before = stories_server.info()["stats"]
    response = generate(stories_server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert stories_server.info()["stats"] == before  # nothing reached the scheduler
