"""Issue 14 (reliability), the scheduler's share: penalties that follow
their definitions exactly (now built incrementally), radix eviction in LRU
order across calls without walking the tree, and an LLM.generate call whose
later prompt is rejected leaving nothing queued."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.kvcache.radix_cache import RadixCache
from aioserve.placeholders import placeholder
from aioserve.scheduler.request import Request
from aioserve.scheduler.sampling_batch import SampleRow, SamplingBatchBuilder
from hf_reference import hf_model

# -- penalties ------------------------------------------------------------------


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float = 0.0,
              frequency: float = 0.0, repetition: float = 1.0, sign: float = 1.0) -> torch.Tensor:
    """The definitions, written out one token at a time (sign=-1 flips each
    penalty into a reward: the test must tell the two apart).
    * repetition (over prompt and output tokens): a positive logit is divided
      by the penalty, a negative one multiplied;
    * presence (once per token in the output) and frequency (per occurrence)
      are subtracted."""
    out = logits.double().clone()
    factor = repetition if sign > 0 else 1.0 / repetition
    for token in set(prompt) | set(output):
        value = out[token]
        out[token] = value / factor if value > 0 else value * factor
    for token in set(output):
        out[token] -= sign * (frequency * output.count(token) + presence)
    return out


PENALTIES = {
    "presence": dict(presence_penalty=1.0),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.6),
    "all": dict(presence_penalty=0.4, frequency_penalty=0.4, repetition_penalty=1.3),
}
KEYS = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition"}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_each_token_is_the_argmax_of_the_penalised_raw_logits(name: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Greedy under a penalty, beside an unpenalised request in the same
    batch (overlap on, so the penalty lists carry the token in flight as a
    placeholder). Every token must be the argmax of transformers' raw logits
    with the penalty applied by its definition; the same check with the
    penalty's sign flipped must fail somewhere, and the penalty must change
    the output."""
    path = tiny_checkpoints["qwen3"]
    options = PENALTIES[name]
    llm = LLM(str(path), page_size=4)
    try:
        prompt = llm.encode("Once upon a time there was a little robot who loved")
        neighbour = llm.encode("The quick brown fox")
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        plain, penal, beside = llm.generate(
            [prompt, prompt, neighbour],
            [greedy, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **options), greedy],
        )
        alone = llm.generate(neighbour, greedy)[0]
    finally:
        llm.close()
    assert beside.token_ids == alone.token_ids, "a penalised row changed its neighbour's tokens"
    assert penal.token_ids != plain.token_ids, "the penalty made no difference: the test proves nothing"
    output = penal.token_ids
    with torch.no_grad():
        raw = hf_model(str(path))(torch.tensor([prompt + output])).logits[0].double()
    definition = {KEYS[k]: v for k, v in options.items()}
    flipped_misses = 0
    for t, token in enumerate(output):
        logits = raw[len(prompt) + t - 1]
        right = penalised(logits, prompt, output[:t], **definition)
        # transformers and the engine round differently: allow 1e-4 of slack, no more.
        assert right[token] >= right.max() - 1e-4, f"token {t}: {token} is not the argmax ({int(right.argmax())})"
        wrong = penalised(logits, prompt, output[:t], sign=-1.0, **definition)
        flipped_misses += bool(wrong[token] < wrong.max() - 1e-2)
    assert flipped_misses > 0, "the tokens also fit the penalty with its sign flipped"


def test_penalty_lists_are_built_incrementally_and_match_the_full_history() -> None:
    """The builder folds in only new tokens, yet each step lists every output
    token once per occurrence (plus the one in flight) and every prompt and
    output token for repetition."""
    builder = SamplingBatchBuilder(vocab_size=100, eos_token_ids=[0], seed=0)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    request = Request("a", [5, 6, 5, 7], params, lambda event: None)
    other = Request("b", [9], SamplingParams(repetition_penalty=1.5), lambda event: None)
    for new in ([], [8], [5], [8, 8], [11]):
        request.all_ids += new
        pending = placeholder(1)
        st = builder.build([SampleRow(other, 0, None), SampleRow(request, request.num_output_tokens, pending)])
        history = request.output_ids + [pending]
        assert st.output_rows.tolist() == [1] * len(history)
        assert sorted(st.output_token_ids.tolist()) == sorted(history)
        seen = list(zip(st.seen_rows.tolist(), st.seen_token_ids.tolist()))
        assert sorted(t for r, t in seen if r == 1) == sorted(set(request.prompt_ids) | set(history))
        assert [t for r, t in seen if r == 0] == [9]


# -- radix eviction ----------------------------------------------------------------


def test_radix_eviction_keeps_lru_order_across_calls_without_walking_the_tree(monkeypatch) -> None:
    cache = RadixCache(page_size=1)
    for first, page in ((1, 10), (2, 20), (3, 30), (4, 40), (5, 50)):
        cache.insert([first, 0], [page, page + 1])  # each: one node of two pages
    cache.match([2, 0, 9])  # 2 is used again: now the newest
    locked = cache.match([3, 0, 9])
    cache.lock(locked)
    cache.insert([1, 0, 7], [10, 11, 12])  # 1 gains a child: only that child is a leaf
    monkeypatch.setattr(cache, "_nodes", lambda: pytest.fail("evict walked the whole tree"))
    # Least recently used first: 4 and 5 (never used again), then 2 (used by
    # the match above); 3 is locked, and 1 is no leaf while it has a child.
    assert cache.evict(1) == [40, 41]
    assert cache.evict(2) == [50, 51]
    assert cache.evict(1) == [20, 21]
    cache.unlock(locked)
    cache.match([3, 0, 9])  # 3 is free again and now the newest
    assert cache.evict(1) == [12]  # 1's child, then 1 itself (used when the child came)
    assert cache.evict(1) == [10, 11]
    assert cache.evict(5) == [30, 31]
    assert cache.evict(1) == [] and cache.num_pages == 0


def test_radix_eviction_survives_many_lock_cycles() -> None:
    """Stale heap entries from lock/unlock cycles are compacted, and eviction
    still finds every leaf in LRU order."""
    cache = RadixCache(page_size=1)
    for i in range(1, 6):
        cache.insert([i, 0], [i * 10, i * 10 + 1])
    for _ in range(500):
        match = cache.match([3, 0, 9])
        cache.lock(match)
        cache.unlock(match)
    assert len(cache._heap) <= 2 * 5 + 64 + 1
    assert cache.evict(100) == [10, 11, 20, 21, 40, 41, 50, 51, 30, 31]


# -- LLM.generate validates the whole call first -------------------------------------


def test_a_rejected_prompt_leaves_nothing_of_its_call_queued(stories_path: Path) -> None:
    llm = LLM(str(stories_path), page_size=4)
    try:
        too_long = [5] * llm.engine.max_model_len
        with pytest.raises(ValueError, match="maximum context length"):
            llm.generate(["Once upon a time", too_long], SamplingParams(max_tokens=4, temperature=0))
        with pytest.raises(ValueError):
            llm.generate(["Once upon a time", "The cat"],
                         [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=-1.0)])
        assert not llm.scheduler.has_work
        generated = llm.stats.generated_tokens
        out = llm.generate("The dog", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out) == 1 and len(out[0].token_ids) == 3
        assert llm.stats.generated_tokens == generated + 3, "an earlier call's prompt ran in this one"
    finally:
        llm.close()
