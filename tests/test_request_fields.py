"""Every request field docs/guide/requests.md lists, through the real server, checked
for its effect rather than for being accepted: a field that the server
parsed and then dropped must fail here.

Sampling filters (top_k, top_p, min_p) are checked against the returned
top_logprobs, which come from the model's raw distribution: with no bias or
penalty the filters rank tokens the same way, so each sampled token's place
in that listing says whether the filter let it through. Each filter test also
samples the same seeds without the filter and requires a token the filter
would have refused; without it, a filter that did nothing would pass.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import SHARED, assert_kv_intact
from hf_reference import hf_tokenizer

PROMPT = "Once upon a time"
STORIES_BOS, STORIES_EOS = 1, 2  # "<s>" and "</s>": special tokens of stories260K
ONCE = 403  # " Once", an ordinary stories260K token
CHAT_PAD = 0  # "<|endoftext|>": special in the tiny ChatML tokenizer, and not its EOS
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


# -- helpers -----------------------------------------------------------------------------


def post(server: Any, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def complete(server: Any, **body: Any) -> dict:
    response = post(server, "/v1/completions", {"prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(server: Any, **body: Any) -> dict:
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    return response.json()


def sse(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def output_ids(server: Any, **sampling: Any) -> list[int]:
    """Token ids, which the OpenAI shapes do not return: SGLang's /generate
    gives them for the same prompt and sampling (test_generate_endpoint.py
    checks that the two endpoints agree)."""
    response = post(server, "/generate", {"text": PROMPT, "sampling_params": sampling})
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def sampled_with_tops(server: Any, seeds: range, **body: Any) -> list[tuple[float, list[float]]]:
    """(chosen token's logprob, the 20 top logprobs best first) for every token
    sampled from `seeds`."""
    pairs = []
    for seed in seeds:
        lp = complete(server, max_tokens=24, seed=seed, logprobs=20, **body)["choices"][0]["logprobs"]
        for chosen, tops in zip(lp["token_logprobs"], lp["top_logprobs"]):
            pairs.append((chosen, sorted(tops.values(), reverse=True)))
    return pairs


SEEDS = range(4)  # 4 x 24 sampled tokens per run: enough for the unfiltered runs to stray


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def kv_intact(stories_server: Any, chat_server: Any) -> Any:
    yield
    assert_kv_intact(stories_server)
    chat_server.wait_idle(timeout=30.0)


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random-weight model with Qwen3's real tokenizer and chat template,
    whose template reads `enable_thinking`."""
    from real_vocab_models import real_vocab_checkpoint
    from server_harness import start_server

    path = real_vocab_checkpoint("qwen3", SHARED, tmp_path_factory.getbasetemp())
    server = start_server(path, "--served-model-name", "tiny-qwen3", "--device", "cpu", "--num-pages", "200")
    server.path = path
    yield server
    server.stop()


# -- logit_bias, stop_token_ids, ignore_eos, min_tokens --------------------------------------


def test_logit_bias_forces_and_forbids_tokens(stories_server: Any, chat_server: Any) -> None:
    greedy = complete(stories_server, max_tokens=8, temperature=0, logprobs=0)["choices"][0]
    # +100 makes " Once" win every step, greedy or sampled.
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        forced = complete(stories_server, max_tokens=8, logit_bias={str(ONCE): 100}, logprobs=0, **sampling)
        assert forced["choices"][0]["logprobs"]["tokens"] == [" Once"] * 8
        assert forced["choices"][0]["text"] == " Once" * 8
    # -100 on greedy's first token: something else comes first.
    first = output_ids(stories_server, max_new_tokens=1, temperature=0)[0]
    banned = complete(stories_server, max_tokens=8, temperature=0, logit_bias={str(first): -100}, logprobs=0)
    assert banned["choices"][0]["logprobs"]["tokens"][0] != greedy["logprobs"]["tokens"][0]
    # Chat takes it too: " robot" is one token of the tiny ChatML vocabulary.
    robot = post(chat_server, "/tokenize", {"prompt": " robot", "add_special_tokens": False}).json()["tokens"]
    assert len(robot) == 1
    forced_chat = chat(chat_server, max_tokens=5, temperature=0, logit_bias={str(robot[0]): 100})
    assert forced_chat["choices"][0]["message"]["content"] == " robot" * 5


def test_stop_token_ids_end_generation_at_that_token(stories_server: Any) -> None:
    full = complete(stories_server, max_tokens=24, temperature=0, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    ids = output_ids(stories_server, max_new_tokens=24, temperature=0)
    stop_id = ids[9]  # " Lily": its first occurrence is known
    first = ids.index(stop_id)
    for stream in (False, True):
        body = {"max_tokens": 24, "temperature": 0, "stop_token_ids": [stop_id], "logprobs": 0, "stream": stream}
        response = post(stories_server, "/v1/completions", {"prompt": PROMPT, **body})
        choices = [c for chunk in sse(response) for c in chunk["choices"]] if stream else response.json()["choices"]
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        assert tokens == full[: first + 1]  # the stop token is the last one generated
        assert choices[-1]["finish_reason"] == "stop"


def test_stop_token_text_is_left_out_unless_asked_for(stories_server: Any) -> None:
    ids = output_ids(stories_server, max_new_tokens=24, temperature=0)
    stop_id = ids[9]
    before = post(stories_server, "/detokenize", {"tokens": [1] + ids[:9]}).json()["prompt"].removeprefix(PROMPT)
    with_stop = post(stories_server, "/detokenize", {"tokens": [1] + ids[:10]}).json()["prompt"].removeprefix(PROMPT)
    body = {"max_tokens": 24, "temperature": 0, "stop_token_ids": [stop_id]}
    assert complete(stories_server, **body)["choices"][0]["text"] == before
    assert complete(stories_server, **body, include_stop_str_in_output=True)["choices"][0]["text"] == with_stop


def test_include_stop_str_in_output(stories_server: Any) -> None:
    whole = complete(stories_server, max_tokens=32, temperature=0)["choices"][0]["text"]
    stop = "l named L"  # spans " girl", " named", " Lily"
    cut = whole.index(stop)
    for stream in (False, True):
        for include, expected in ((False, whole[:cut]), (True, whole[: cut + len(stop)])):
            body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stop": [stop], "stream": stream,
                    "include_stop_str_in_output": include}
            response = post(stories_server, "/v1/completions", body)
            choices = [c for chunk in sse(response) for c in chunk["choices"]] if stream else response.json()["choices"]
            assert "".join(c["text"] for c in choices) == expected
            assert choices[-1]["finish_reason"] == "stop"
            if not stream:  # a whole response's choice with stop strings is still read every step: ended early
                assert response.json()["usage"]["completion_tokens"] < 32


def test_eos_ends_generation_unless_ignore_eos(stories_server: Any) -> None:
    # stories260K never picks its EOS on its own: a bias makes it.
    eos = {str(STORIES_EOS): 100}
    stopped = complete(stories_server, max_tokens=6, temperature=0, logit_bias=eos)
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    assert stopped["choices"][0]["text"] == ""
    ignored = complete(stories_server, max_tokens=6, temperature=0, logit_bias=eos, ignore_eos=True, logprobs=0)
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 6
    assert ignored["choices"][0]["logprobs"]["tokens"] == ["</s>"] * 6


def test_min_tokens_holds_back_an_eos_that_would_win(stories_server: Any) -> None:
    """With EOS pushed to the top, the answer is EOS at once; min_tokens N
    forbids it for N tokens (which are then greedy's own) and EOS follows."""
    eos = {str(STORIES_EOS): 100}
    greedy = complete(stories_server, max_tokens=8, temperature=0, logprobs=0)["choices"][0]
    assert complete(stories_server, max_tokens=8, temperature=0, logit_bias=eos)["usage"]["completion_tokens"] == 1
    for n in (1, 5):
        held = complete(stories_server, max_tokens=8, temperature=0, logit_bias=eos, min_tokens=n, logprobs=0)
        choice = held["choices"][0]
        assert choice["logprobs"]["tokens"] == greedy["logprobs"]["tokens"][:n] + ["</s>"]
        assert held["usage"]["completion_tokens"] == n + 1 and choice["finish_reason"] == "stop"
    # It holds back stop_token_ids the same way.
    stop = {"logit_bias": {str(ONCE): 100}, "stop_token_ids": [ONCE]}
    assert complete(stories_server, max_tokens=8, temperature=0, logprobs=0, **stop)["usage"]["completion_tokens"] == 1
    held = complete(stories_server, max_tokens=8, temperature=0, logprobs=0, min_tokens=3, **stop)["choices"][0]
    assert held["logprobs"]["tokens"] == greedy["logprobs"]["tokens"][:3] + [" Once"]


# -- top_k, top_p, min_p -----------------------------------------------------------------


def test_top_k_1_is_greedy(stories_server: Any) -> None:
    greedy = complete(stories_server, max_tokens=24, temperature=0)["choices"][0]["text"]
    for seed in SEEDS:
        sampled = complete(stories_server, max_tokens=24, temperature=1.5, top_k=1, seed=seed)
        assert sampled["choices"][0]["text"] == greedy


def test_temperature_scales_the_distribution(stories_server: Any) -> None:
    # One seed, so the uniform draws are the same: near 0 the argmax takes all
    # the mass (greedy's text); at 1.5 the same draws land elsewhere.
    greedy = complete(stories_server, max_tokens=24, temperature=0)["choices"][0]["text"]
    assert complete(stories_server, max_tokens=24, temperature=0.02, seed=1)["choices"][0]["text"] == greedy
    assert complete(stories_server, max_tokens=24, temperature=1.5, seed=1)["choices"][0]["text"] != greedy


def test_top_k_2_samples_among_the_top_two(stories_server: Any) -> None:
    def outside_top_2(pairs: list[tuple[float, list[float]]]) -> int:
        return sum(chosen < tops[1] - 1e-4 for chosen, tops in pairs)

    assert outside_top_2(sampled_with_tops(stories_server, SEEDS, temperature=1.5, top_k=2)) == 0
    assert outside_top_2(sampled_with_tops(stories_server, SEEDS, temperature=1.5)) > 0


def test_top_p_samples_from_the_nucleus(stories_server: Any) -> None:
    top_p = 0.6

    def outside_nucleus(pairs: list[tuple[float, list[float]]]) -> int:
        # At temperature 1 the raw logprobs are the sampling distribution: a
        # token is kept while the mass ranked above it is below top_p.
        return sum(sum(math.exp(v) for v in tops if v > chosen + 1e-4) >= top_p for chosen, tops in pairs)

    assert outside_nucleus(sampled_with_tops(stories_server, SEEDS, temperature=1.0, top_p=top_p)) == 0
    assert outside_nucleus(sampled_with_tops(stories_server, SEEDS, temperature=1.0)) > 0


def test_min_p_keeps_tokens_near_the_peak(stories_server: Any) -> None:
    min_p, temperature = 0.2, 1.5

    def below_min_p(pairs: list[tuple[float, list[float]]]) -> int:
        # min_p applies to the tempered distribution: p(x) >= min_p * p(best),
        # i.e. (logprob(x) - logprob(best)) / T >= log(min_p).
        return sum((chosen - tops[0]) / temperature < math.log(min_p) - 1e-4 for chosen, tops in pairs)

    assert below_min_p(sampled_with_tops(stories_server, SEEDS, temperature=temperature, min_p=min_p)) == 0
    assert below_min_p(sampled_with_tops(stories_server, SEEDS, temperature=temperature)) > 0


# -- text: skip_special_tokens, echo ---------------------------------------------------------


def test_skip_special_tokens(stories_server: Any, chat_server: Any) -> None:
    bos = {str(STORIES_BOS): 100}
    skipped = complete(stories_server, max_tokens=3, temperature=0, logit_bias=bos)["choices"][0]["text"]
    shown = complete(stories_server, max_tokens=3, temperature=0, logit_bias=bos, skip_special_tokens=False)
    assert skipped == "" and shown["choices"][0]["text"] == "<s>" * 3
    pad = {str(CHAT_PAD): 100}
    assert chat(chat_server, max_tokens=3, temperature=0, logit_bias=pad)["choices"][0]["message"]["content"] == ""
    shown_chat = chat(chat_server, max_tokens=3, temperature=0, logit_bias=pad, skip_special_tokens=False)
    assert shown_chat["choices"][0]["message"]["content"] == "<|endoftext|>" * 3


def test_streamed_echo_starts_with_the_detokenized_prompt(stories_server: Any, stories_path: Path) -> None:
    ids = hf_tokenizer(str(stories_path))(PROMPT).input_ids
    prompt_text = hf_tokenizer(str(stories_path)).decode(ids, skip_special_tokens=True)
    continuation = complete(stories_server, max_tokens=6, temperature=0)["choices"][0]["text"]
    for prompt in (PROMPT, ids):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True, "stream": True, "n": 2}
        chunks = sse(post(stories_server, "/v1/completions", body))
        for index in (0, 1):
            texts = [c["text"] for chunk in chunks for c in chunk["choices"] if c["index"] == index]
            assert texts[0].startswith(prompt_text)  # the echo comes first, in the choice's first chunk
            assert "".join(texts) == prompt_text + continuation
    plain = sse(post(stories_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}))
    assert "".join(c["text"] for chunk in plain for c in chunk["choices"]) == continuation


# -- user ------------------------------------------------------------------------------------


def test_user_is_accepted_and_changes_nothing(stories_server: Any, chat_server: Any) -> None:
    """OpenAI's `user` is a string that identifies the end user to OpenAI;
    vLLM accepts and ignores it. Same output, echoed nowhere; a non-string is
    a 400 naming the field."""
    user = "user-7f3a-unique"
    plain = complete(stories_server, max_tokens=6, temperature=0)
    tagged = complete(stories_server, max_tokens=6, temperature=0, user=user)
    assert tagged["choices"] == plain["choices"] and user not in json.dumps(tagged)
    chat_plain = chat(chat_server, max_tokens=6, temperature=0)
    chat_tagged = chat(chat_server, max_tokens=6, temperature=0, user=user)
    assert chat_tagged["choices"] == chat_plain["choices"] and user not in json.dumps(chat_tagged)
    for server, path, body in (
        (stories_server, "/v1/completions", {"prompt": PROMPT}),
        (chat_server, "/v1/chat/completions", {"messages": MESSAGES}),
    ):
        for bad in (123, {"id": user}):
            response = post(server, path, {**body, "max_tokens": 2, "user": bad})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "user"


# -- chat: max_completion_tokens, n, logprobs, chat_template_kwargs ----------------------------


def test_max_completion_tokens_bounds_the_completion_and_wins(chat_server: Any) -> None:
    def tokens(**limits: int) -> int:
        body = chat(chat_server, temperature=0, ignore_eos=True, **limits)
        assert body["choices"][0]["finish_reason"] == "length"
        return body["usage"]["completion_tokens"]

    assert tokens(max_completion_tokens=3) == 3
    # OpenAI deprecated max_tokens for max_completion_tokens: given both, the latter counts.
    assert tokens(max_tokens=9, max_completion_tokens=4) == 4
    assert tokens(max_tokens=4, max_completion_tokens=9) == 9
    response = post(chat_server, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_completion_tokens"


def test_chat_n_gives_n_distinct_choices(chat_server: Any) -> None:
    body = chat(chat_server, max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True, logprobs=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["message"]["content"] for c in choices}) == 3  # seeded, yet each choice samples its own
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices) == 36
    again = chat(chat_server, max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True, logprobs=True)
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in choices]  # and the seed holds
    streamed = sse(post(chat_server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True, "stream": True,
    }))
    for choice in choices:
        content = "".join(c["delta"].get("content") or "" for chunk in streamed for c in chunk["choices"]
                          if c["index"] == choice["index"])
        assert content == choice["message"]["content"]


def test_chat_logprobs_without_streaming(chat_server: Any) -> None:
    """The chat answer's logprobs are those of the same tokens continuing the
    rendered prompt through /v1/completions."""
    body = chat(chat_server, max_tokens=8, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 8
    prompt_ids = post(chat_server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    reference = complete(chat_server, prompt=prompt_ids, max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    ref = reference["choices"][0]["logprobs"]
    assert [e["token"] for e in content] == ref["tokens"]
    assert [e["logprob"] for e in content] == pytest.approx(ref["token_logprobs"], abs=1e-5)
    for entry, ref_top in zip(content, ref["top_logprobs"]):
        assert len(entry["top_logprobs"]) == 3
        assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]} == pytest.approx(ref_top, abs=1e-5)
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-6)  # greedy: the best
        assert entry["bytes"] == list(entry["token"].encode())
    without = chat(chat_server, max_tokens=8, temperature=0, ignore_eos=True)
    assert without["choices"][0]["logprobs"] is None
    assert without["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


def test_text_part_content_is_the_joined_string(chat_server: Any, llama_path: Path) -> None:
    """Content given as text parts renders as the parts joined by newlines:
    the prompt is transformers' rendering of the joined string."""
    parts = [{"type": "text", "text": "Tell me about"}, {"type": "text", "text": "the sea."}]
    joined = [{"role": "user", "content": "Tell me about\nthe sea."}]
    as_parts = chat(chat_server, messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0)
    as_string = chat(chat_server, messages=joined, max_tokens=6, temperature=0)
    assert as_parts["choices"] == as_string["choices"]
    tokenizer = hf_tokenizer(str(llama_path))  # chat_server serves this checkpoint
    text = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
    reference = tokenizer(text, add_special_tokens=False).input_ids
    assert as_parts["usage"]["prompt_tokens"] == len(reference)
    served = post(chat_server, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()["tokens"]
    assert served == reference


def test_chat_template_kwargs_reach_the_template(qwen3_server: Any) -> None:
    """Qwen3's template opens an empty <think></think> block when
    enable_thinking is false: the prompt the server encodes is the template's
    rendering with those kwargs (transformers renders the reference)."""
    tokenizer = hf_tokenizer(str(qwen3_server.path))

    def prompt_tokens(**extra: Any) -> int:
        body = chat(qwen3_server, model="tiny-qwen3", max_tokens=1, temperature=0, **extra)
        return body["usage"]["prompt_tokens"]

    def rendered(**kwargs: Any) -> list[int]:
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False).input_ids

    thinking, not_thinking = rendered(), rendered(enable_thinking=False)
    assert len(not_thinking) > len(thinking)  # the reference itself tells them apart
    assert prompt_tokens() == len(thinking)
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == len(thinking)
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == len(not_thinking)
    streamed = sse(post(qwen3_server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }))
    assert streamed[-1]["usage"]["prompt_tokens"] == len(not_thinking)
    bad = post(qwen3_server, "/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": ["x"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_openai_client_sends_the_extra_fields(stories_client: openai.OpenAI, stories_model: str) -> None:
    """The vLLM fields go through the official client's extra_body and do the
    same there (a client-side spelling mistake would silently drop them)."""
    forced = stories_client.completions.create(
        model=stories_model, prompt=PROMPT, max_tokens=3, temperature=0,
        extra_body={"logit_bias": {str(STORIES_BOS): 100}, "skip_special_tokens": False, "top_k": 1, "min_p": 0.1},
    )
    assert forced.choices[0].text == "<s>" * 3


def test_completion_top_logprobs_include_the_sampled_token(stories_server: Any) -> None:
    """OpenAI: the sampled token's logprob is always returned, so up to
    logprobs + 1 entries. A bias makes EOS the chosen token while the raw
    distribution's top 1 is another one."""
    body = {"max_tokens": 6, "min_tokens": 3, "logit_bias": {str(STORIES_EOS): 100}, "temperature": 0, "logprobs": 1}
    logprobs = complete(stories_server, **body)["choices"][0]["logprobs"]
    last_token, last_top = logprobs["tokens"][-1], logprobs["top_logprobs"][-1]
    assert len(last_top) == 2 and last_top[last_token] == logprobs["token_logprobs"][-1]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert token in top and 1 <= len(top) <= 2
