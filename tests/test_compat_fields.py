"""vLLM's and SGLang's request fields through the real server: prompt_logprobs
in vLLM's shape, continue_final_message, chat echo, stop_reason, min_tokens
holding back stop strings, and a 400 naming each field aioserve cannot honour
(lora_path, image_data, ...) instead of dropping it."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

PROMPT = "Once upon a time"


def post(server: Any, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def ok(server: Any, path: str, body: dict) -> dict:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def refused(server: Any, path: str, body: dict, param: str) -> str:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


def sse(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def prompt_ids(server: Any, text: str) -> list[int]:
    return ok(server, "/tokenize", {"prompt": text})["tokens"]


# -- prompt_logprobs --------------------------------------------------------------------


def test_completion_prompt_logprobs_in_vllm_shape(stories_server: Any) -> None:
    ids = prompt_ids(stories_server, PROMPT)
    body = ok(stories_server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3, "echo": True, "logprobs": 0,
    })
    choice = body["choices"][0]
    listing = choice["prompt_logprobs"]
    assert len(listing) == len(ids) and listing[0] is None
    echoed = choice["logprobs"]["token_logprobs"][: len(ids)]  # the echo scores the same prompt
    for position in range(1, len(ids)):
        entry = listing[position]
        own = entry[str(ids[position])]
        assert math.isclose(own["logprob"], echoed[position], abs_tol=1e-4)
        tops = sorted((v for k, v in entry.items() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [t["rank"] for t in tops] == [1, 2, 3]  # the 3 likeliest, ranked
        assert tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]
        # The prompt token's rank places it among them (or after them).
        assert own["rank"] == 1 + sum(1 for t in tops if t["logprob"] > own["logprob"] + 1e-6) or own["rank"] > 3
        assert isinstance(own["decoded_token"], str) and all("decoded_token" in v for v in entry.values())
        assert len(entry) in (3, 4)  # the own token is listed beside the 3 when it is not among them
    # Not asked for: not in the body at all.
    plain = ok(stories_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert "prompt_logprobs" not in plain["choices"][0]


def test_chat_prompt_logprobs_cover_the_rendered_prompt(stories_server: Any) -> None:
    body = ok(stories_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 2, "prompt_logprobs": 1,
    })
    listing = body["prompt_logprobs"]
    assert len(listing) == body["usage"]["prompt_tokens"] and listing[0] is None
    assert all(any(v["rank"] == 1 for v in entry.values()) for entry in listing[1:])


def test_prompt_logprobs_refused_in_a_stream(stories_server: Any) -> None:
    refused(stories_server, "/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1},
            "prompt_logprobs")
    refused(stories_server, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs")


# -- stop_reason and min_tokens ---------------------------------------------------------


def greedy(server: Any, **body: Any) -> dict:
    return ok(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 24, **body})


def test_stop_reason_names_the_stop_string_or_token(stories_server: Any) -> None:
    text = greedy(stories_server)["choices"][0]["text"]
    word = text.split()[2]
    stopped = greedy(stories_server, stop=[word, "zzzz"])["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", word)
    ids = ok(stories_server, "/generate", {
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 24},
    })["output_ids"]
    by_id = greedy(stories_server, stop_token_ids=[ids[3]])["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", ids[3])
    at_length = greedy(stories_server, max_tokens=2)["choices"][0]
    assert (at_length["finish_reason"], at_length["stop_reason"]) == ("length", None)
    # Streams carry it on the finishing chunk; chat too.
    chunks = sse(post(stories_server, "/v1/completions", {
        "prompt": PROMPT, "temperature": 0, "max_tokens": 24, "stop": [word], "stream": True,
    }))
    assert [c["choices"][0]["stop_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [word]
    chat = ok(stories_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 3,
    })
    assert chat["choices"][0]["stop_reason"] is None and "stop_reason" in chat["choices"][0]


def test_min_tokens_holds_back_stop_strings(stories_server: Any) -> None:
    free = greedy(stories_server, max_tokens=40)
    text = free["choices"][0]["text"]
    word = text.split()[1]  # appears early
    early = greedy(stories_server, max_tokens=40, stop=[word])["choices"][0]
    assert early["finish_reason"] == "stop"
    held = greedy(stories_server, max_tokens=40, stop=[word], min_tokens=20)
    assert held["usage"]["completion_tokens"] >= 20
    assert word in held["choices"][0]["text"]  # the early occurrence passed through
    assert len(held["choices"][0]["text"]) > len(early["text"])


# -- continue_final_message and echo --------------------------------------------------


STARTED = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time"}]


def test_continue_final_message_leaves_the_message_open(stories_server: Any, stories_path: Any) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(stories_path))
    open_ids = hf.apply_chat_template(STARTED, continue_final_message=True, tokenize=True)
    closed_ids = hf.apply_chat_template(STARTED, add_generation_prompt=False, tokenize=True)
    open_ids = open_ids["input_ids"] if hasattr(open_ids, "keys") else open_ids  # a BatchEncoding in transformers 5
    closed_ids = closed_ids["input_ids"] if hasattr(closed_ids, "keys") else closed_ids
    assert len(open_ids) != len(closed_ids)  # the template closes a finished message
    body = ok(stories_server, "/v1/chat/completions", {
        "messages": STARTED, "add_generation_prompt": False, "continue_final_message": True,
        "max_tokens": 4, "temperature": 0,
    })
    assert body["usage"]["prompt_tokens"] == len(open_ids)
    refused(stories_server, "/v1/chat/completions", {"messages": STARTED, "continue_final_message": True},
            "continue_final_message")
    refused(stories_server, "/v1/chat/completions", {
        "messages": STARTED[:1], "add_generation_prompt": False, "continue_final_message": True,
    }, "messages")


def test_chat_echo_prepends_the_final_assistant_message(stories_server: Any) -> None:
    request = {
        "messages": STARTED, "add_generation_prompt": False, "continue_final_message": True,
        "max_tokens": 6, "temperature": 0,
    }
    plain = ok(stories_server, "/v1/chat/completions", request)["choices"][0]["message"]["content"]
    echoed = ok(stories_server, "/v1/chat/completions", {**request, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "Once upon a time" + plain
    chunks = sse(post(stories_server, "/v1/chat/completions", {**request, "echo": True, "stream": True}))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == echoed
    # A final message that is the user's is not echoed (the output is the assistant's).
    user_last = ok(stories_server, "/v1/chat/completions", {
        "messages": STARTED[:1], "max_tokens": 6, "temperature": 0, "echo": True,
    })["choices"][0]["message"]["content"]
    assert not user_last.startswith("Tell me a story.")


# -- fields that cannot be honoured ---------------------------------------------------


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/generate", {"lora_path": "adapters/a"}, "lora_path"),
    ("/generate", {"image_data": "https://example.com/cat.png"}, "image_data"),
    ("/generate", {"input_embeds": [[0.1, 0.2]]}, "input_embeds"),
    ("/v1/completions", {"lora_path": "adapters/a"}, "lora_path"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"image_data": ["x.png"]}, "image_data"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"bad_words": ["dragon"]}, "bad_words"),
])
def test_unhonourable_fields_are_refused_by_name(stories_server: Any, path: str, extra: dict, param: str) -> None:
    base = {
        "/generate": {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}},
        "/v1/completions": {"prompt": PROMPT, "max_tokens": 2},
        "/v1/chat/completions": {"messages": STARTED[:1], "max_tokens": 2},
    }[path]
    assert param in refused(stories_server, path, {**base, **extra}, param)
    # Sent with its neutral value, the field asks for nothing and passes.
    neutral = {"lora_path": None, "use_beam_search": False, "modalities": ["text"], "image_data": []}
    if param in neutral:
        ok(stories_server, path, {**base, param: neutral[param]})
