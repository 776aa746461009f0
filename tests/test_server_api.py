"""The OpenAI API through the real server and the official openai client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from aioserve import LLM, SamplingParams
from hf_reference import hf_encode, hf_greedy, hf_tokenizer

PROMPT = "Once upon a time"


# The stories server's KV pool is checked after every test (conftest.stories_kv_intact).
pytestmark = pytest.mark.usefixtures("stories_kv_intact")


@pytest.fixture(scope="module")
def offline(stories_path: Path) -> LLM:
    llm = LLM(str(stories_path))
    yield llm
    llm.close()


def test_greedy_completion_equals_offline_and_hf(stories_client, stories_model, offline, stories_path) -> None:
    prompts = [PROMPT, "The little dog", "Lily and Ben went to the park. They"]
    for prompt in prompts:
        out = stories_client.completions.create(model=stories_model, prompt=prompt, max_tokens=24, temperature=0)
        local = offline.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0]
        ref, _ = hf_greedy(stories_path, hf_encode(stories_path, prompt), 24)
        assert local.token_ids == ref
        assert out.choices[0].text == local.text
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(local.prompt_token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_streaming_equals_non_streaming_with_usage(stories_client, stories_model) -> None:
    whole = stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        stories_client.completions.create(
            model=stories_model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_prompt_forms_and_n(stories_client, stories_model, offline) -> None:
    ids = offline.tokenizer.encode(PROMPT)
    batch = stories_client.completions.create(model=stories_model, prompt=[PROMPT, "The dog"], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both choices agree
    by_ids = stories_client.completions.create(model=stories_model, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == batch.choices[0].text
    by_id_lists = stories_client.completions.create(model=stories_model, prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [c.text for c in by_id_lists.choices] == [batch.choices[0].text] * 2
    sampled = stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=7)
    assert sampled.choices[0].text != sampled.choices[1].text
    assert sampled.usage.completion_tokens == 32 and sampled.usage.prompt_tokens == len(ids)


def test_seed_reproducibility(stories_client, stories_model) -> None:
    def sample(seed: int) -> str:
        return stories_client.completions.create(
            model=stories_model, prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=seed
        ).choices[0].text

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_stop_strings_are_cut_across_tokens(stories_client, stories_model) -> None:
    whole = stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    cut = whole.index("l named L")
    out = stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=32, temperature=0, stop=["l named L"])
    assert out.choices[0].text == whole[:cut] and out.choices[0].finish_reason == "stop"
    streamed = stories_client.completions.create(
        model=stories_model, prompt=PROMPT, max_tokens=32, temperature=0, stop="l named L", stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == whole[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_and_echo(stories_client, stories_model, offline, stories_path) -> None:
    out = stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    local = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    # Echo: the prompt's text, then exactly what 4 greedy tokens give offline.
    # With token ids for a prompt the server must detokenize them itself, so
    # its echo is checked against transformers' decoding of those ids.
    four = offline.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0].text
    prompt_ids = hf_encode(stories_path, PROMPT)
    prompt_text = hf_tokenizer(str(stories_path)).decode(prompt_ids, skip_special_tokens=True)
    assert prompt_text == PROMPT  # the tokenizer round-trips it: the string form can be compared too
    for prompt in (PROMPT, prompt_ids):
        echoed = stories_client.completions.create(
            model=stories_model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
        )
        assert echoed.choices[0].text == prompt_text + four
    choice = echoed.choices[0]
    # Prompt token logprobs: none for the first, then transformers' values.
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids) + 4
    import torch

    from hf_reference import hf_model

    with torch.no_grad():
        logits = hf_model(str(stories_path))(torch.tensor([prompt_ids])).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    assert choice.logprobs.token_logprobs[1 : len(prompt_ids)] == pytest.approx(expected.tolist(), abs=1e-4)


def test_penalties_change_outputs(stories_client, stories_model) -> None:
    def text(**kwargs) -> str:
        return stories_client.completions.create(model=stories_model, prompt=PROMPT, max_tokens=48, temperature=0, **kwargs).choices[0].text

    plain = text()
    assert text(frequency_penalty=1.5) != plain
    assert text(presence_penalty=1.5) != plain
    assert text(extra_body={"repetition_penalty": 1.8}) != plain
    # min_tokens and top_k are checked for their effect in test_request_fields.py.


def test_token_endpoints_and_models(stories_server, stories_model) -> None:
    import httpx

    tokens = httpx.post(f"{stories_server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == [1, 403, 407, 261, 378] and tokens["count"] == 5
    text = httpx.post(f"{stories_server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == PROMPT
    models = httpx.get(f"{stories_server.v1}/models").json()
    assert models["data"][0]["id"] == stories_model and models["data"][0]["max_model_len"] == 512


def test_chat_completion_streaming_and_not(chat_server, chat_client) -> None:
    messages = [
        {"role": "system", "content": "You are a robot."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me about"}, {"type": "text", "text": "the sea."}]},
    ]
    whole = chat_client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("length", "stop")
    chunks = list(
        chat_client.chat.completions.create(
            model="tiny-chat", messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, logprobs=True, top_logprobs=2,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    logprob_entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(logprob_entries) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in logprob_entries)
    # The prompt is the ChatML rendering, encoded without a second BOS.
    import httpx

    rendered = httpx.post(f"{chat_server.url}/tokenize", json={"messages": messages}).json()
    assert whole.usage.prompt_tokens == rendered["count"]
