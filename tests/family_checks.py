"""Checks every model family's tests run on their tiny checkpoints:
chunked prefill, prefix-cache hits and preemption leave greedy tokens as
transformers has them; a chat over HTTP through the model's own template
equals transformers' greedy continuation of that prompt."""

from __future__ import annotations

from pathlib import Path

from aioserve import LLM, SamplingParams
from hf_reference import hf_encode, hf_greedy, hf_tokenizer
from test_greedy_matches_hf import PROMPTS


def check_chunked_cached_preempted(path: Path) -> None:
    """A 16-token prefill budget chunks the long prompts; the second round
    hits the prefix cache; a pool too small for all at once preempts."""
    prompts = [hf_encode(path, p) for p in PROMPTS[1:3]] + [list(range(20 + i, 60 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [hf_greedy(path, p, 16)[0] for p in prompts]
    llm = LLM(str(path), page_size=4, max_prefill_tokens=16, num_pages=40, decode_reserve_tokens=4)
    try:
        first = llm.generate(prompts, params)
        assert [o.token_ids for o in first] == expected
        assert llm.stats.preemptions > 0
        for _ in range(2):  # the second time from the prefix cache
            again = llm.generate(prompts[:1], params)[0]
            assert again.token_ids == expected[0]
        assert again.num_cached_tokens >= 16
        llm.scheduler.check_integrity()
    finally:
        llm.close()


def check_chat_over_http(path: Path, messages: list[dict], max_tokens: int = 12) -> None:
    """The server's chat completion (greedy, logprobs) against transformers
    on the prompt the HF tokenizer's chat template writes."""
    import openai
    from server_harness import start_server

    tokenizer = hf_tokenizer(str(path))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf_encode(path, prompt)
    expected, expected_logprobs = hf_greedy(path, ids, max_tokens)
    server = start_server(path, "--page-size", "4")
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=server.info()["model"], messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == max_tokens
        got = [t.logprob for t in out.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(got, expected_logprobs, strict=True)) < 1e-4
        # The text, but for a trailing partial UTF-8 character the server holds back.
        text = tokenizer.decode(expected, skip_special_tokens=False)
        content = out.choices[0].message.content
        assert text.startswith(content) and len(content) >= len(text.rstrip("\ufffd"))
    finally:
        server.stop()
