"""Greedy outputs do not depend on how requests are batched, paged, cached,
chunked or overlapped."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioserve import LLM, SamplingParams
from hf_reference import hf_encode

TEXTS = [
    "Once upon a time there was a little robot",
    "The quick brown fox",
    "every morning the robot walked to the library, opened a big blue book and read about fish, whales, boats",
    "Héllo 世界 🙂",
    "What will you do when you finish all the books?",
    "0123456789 + - * / = ( ) [ ] { } < > ! ?",
    "the end of the story. " * 6,
    "naïve café",
]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama3-rope"]


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[list[int]]:
    return [hf_encode(model, t) for t in TEXTS]


@pytest.fixture(scope="module")
def one_at_a_time(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model), page_size=16, cache="naive", overlap=False)
    results = [llm.generate([p], PARAMS)[0].token_ids for p in prompts]
    llm.close()
    return results


def generate_all(model: Path, prompts: list[list[int]], **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), debug_integrity=True, **options)
    outputs = llm.generate(prompts, PARAMS)
    llm.scheduler.check_integrity()
    return [o.token_ids for o in outputs], llm


@pytest.mark.parametrize(
    "options",
    [
        dict(page_size=16),
        dict(page_size=1),
        dict(page_size=16, overlap=False),
        dict(page_size=4, cache="naive"),
        dict(page_size=4, max_prefill_tokens=7),
        dict(page_size=2, max_running_requests=3),
    ],
    ids=["batched", "page1", "no-overlap", "naive-cache", "chunk7", "3-slots"],
)
def test_batched_equals_one_at_a_time(model, prompts, one_at_a_time, options) -> None:
    outputs, llm = generate_all(model, prompts, **options)
    assert outputs == one_at_a_time
    llm.close()


def test_small_pool_makes_requests_wait(model, prompts, one_at_a_time) -> None:
    # 4-token pages; the longest request needs 11 pages, all together ~70.
    outputs, llm = generate_all(model, prompts, page_size=4, num_pages=24, decode_reserve_tokens=4)
    assert outputs == one_at_a_time
    assert llm.stats.peak_running < len(prompts)
    llm.close()


def test_repeated_generate_reuses_prefix_cache(model, prompts, one_at_a_time) -> None:
    llm = LLM(str(model), page_size=4, debug_integrity=True)
    first = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    second = llm.generate(prompts, PARAMS)
    assert first == one_at_a_time
    assert [o.token_ids for o in second] == one_at_a_time
    # The second round finds every prompt's whole pages cached (the last token is always computed).
    for ids, out in zip(prompts, second):
        assert out.num_cached_tokens == (len(ids) - 1) // 4 * 4
    llm.scheduler.check_integrity()
    llm.close()
