"""Bad input gets an OpenAI-style 4xx error, never reaches the scheduler,
and never hurts the server."""

from __future__ import annotations

import httpx
import pytest

from server_harness import start_server


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),  # 0 is fine: it scores the prompt
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
        ({"prompt": [1, 2, 99999]}, 400, "prompt"),
        ({"prompt": "hi " * 600, "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
        ({"prompt": "hi", "stop_token_ids": [-3]}, 400, "stop_token_ids"),
        ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_completion_requests(stories_server, body, status, param) -> None:
    before = stories_server.info()["stats"]
    assert_error(post(stories_server, "/v1/completions", json=body), status, param)
    assert stories_server.info()["stats"] == before  # nothing reached the scheduler


def test_malformed_bodies_and_routes(stories_server) -> None:
    assert_error(post(stories_server, "/v1/completions", content=b"{not json"), 400)
    assert_error(post(stories_server, "/v1/completions", json=[1, 2]), 400)
    assert_error(post(stories_server, "/v1/completions", content=b"\xff\xfe"), 400)
    assert_error(httpx.get(f"{stories_server.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{stories_server.url}/v1/completions"), 405)
    assert_error(post(stories_server, "/v1/completions", json={"prompt": "x", "model": "other"}), 404, code="model_not_found")


def test_bad_chat_requests(templateless_server, chat_server) -> None:
    error = assert_error(post(templateless_server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}), 400, "messages")
    assert "chat template" in error["message"]
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.0.function"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages.0.content"),
    ]:
        assert_error(post(chat_server, "/v1/chat/completions", json=body), 400, param)


def test_token_endpoints_reject_bad_input(stories_server) -> None:
    assert_error(post(stories_server, "/detokenize", json={"tokens": [1, -5]}), 400, "tokens")
    assert_error(post(stories_server, "/tokenize", json={}), 400, "prompt")


def test_a_client_leaving_a_whole_response_aborts_it_quietly(stories_server) -> None:
    before = stories_server.info()["stats"]["aborted"]
    log_start = len(stories_server.log())
    # 500 tokens of stories260K take ~0.3 s on 2 cores (greedy screen): the client
    # leaves long before the end (at 0.3 s it sometimes saw the whole answer).
    body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stories_server.url}/v1/completions", json=body, timeout=0.08)
    info = stories_server.wait_idle(timeout=10)
    assert info["stats"]["aborted"] == before + 1
    log = stories_server.log()[log_start:]
    assert "client left; aborted" in log
    assert "Traceback" not in log and "InvalidStateError" not in log


def test_server_is_fine_after_all_that(stories_server) -> None:
    assert httpx.get(f"{stories_server.url}/health").status_code == 200
    out = post(stories_server, "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0})
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == ", there was"


def test_api_key(stories_path) -> None:
    server = start_server(stories_path, "--api-key", "s3cret")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert_error(post(server, "/v1/completions", json=body), 401, code="invalid_api_key")
        assert_error(post(server, "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert post(server, "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    finally:
        server.stop()
