"""The offline API at tp 2 gives what tp 1 (and transformers) give: greedy
and seeded sampling, chunked prefill, prefix-cache hits, stop strings (an
abort), preemption; Llama with GQA, Qwen2, Qwen3 and a model with one KV
head (replicated on both ranks). Each LLM(tp=2) starts one follower process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from hf_reference import hf_greedy
from tiny_models import TINY, build_tokenizer

LONG = list(range(10, 70))  # 60 tokens: 4 chunks of 16
PROMPTS = [[5, 6, 7], LONG, list(range(100, 123)), [42]]
SHARED = LONG[:40]  # the long prompt's first 10 pages: cached after the first batch


@pytest.fixture(scope="session")
def mqa_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with 4 query heads and 1 KV head: at tp 2 each rank holds a copy."""
    import transformers
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("mqa")
    vocab = build_tokenizer(folder)
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    fields = {**TINY, "num_key_value_heads": 1, "tie_word_embeddings": True}
    config = transformers.LlamaConfig(vocab_size=vocab + 8, eos_token_id=eos, bos_token_id=None, **fields)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def _params(i: int, **extra) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True, **extra)
    return SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, **extra)


def run_mix(llm: LLM, stop_prompt: list[int], stop: str) -> list[tuple]:
    """A batch that chunks a long prompt, one that hits its cached prefix, and
    one ended by a stop string (an abort); what each request produced."""
    first = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    second = llm.generate([SHARED + [7, 8, 9], SHARED + [200]], [_params(0), _params(1)])
    third = llm.generate(stop_prompt, SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    return [(o.token_ids, o.finish_reason, o.num_cached_tokens) for o in first + second + third]


def check_tp2_matches_tp1(path: Path, **options) -> list[tuple]:
    results, texts = [], []
    for tp in (1, 2):
        llm = LLM(str(path), page_size=4, max_prefill_tokens=16, tp=tp, **options)
        try:
            assert llm.engine.tp.size == tp and len(llm.engine.tp_layout) == tp
            probes = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
            texts.append([o.text for o in probes])
            # A stop string met a few tokens into a greedy continuation (some
            # tiny-model tokens decode to nothing, so find one with text).
            index, text = next((i, t) for i, t in enumerate(texts[0]) if len(t) >= 4)
            results.append(run_mix(llm, PROMPTS[index], text[2:4]))
        finally:
            llm.close()
    expected, got = results
    assert texts[0] == texts[1]
    assert got == expected
    assert any(cached > 0 for _, _, cached in got), "the second batch should hit the prefix cache"
    assert got[-1][1] == "stop"
    return got


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_tp1_and_transformers(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints[arch]
    got = check_tp2_matches_tp1(path)
    for prompt, (tokens, _, _) in zip(PROMPTS[::2], got[::2]):  # the greedy ones
        assert tokens == hf_greedy(path, prompt, 12)[0]


def test_one_kv_head_replicated_over_two_ranks(mqa_path: Path) -> None:
    got = check_tp2_matches_tp1(mqa_path)
    assert got[0][0] == hf_greedy(mqa_path, PROMPTS[0], 12)[0]


def test_preemption_under_tp(llama_path: Path) -> None:
    """A pool too small for every request at once: the newest are preempted
    and recomputed, on every rank alike."""
    prompts = [list(range(20 + i, 44 + i)) for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.8 if i % 2 else 0, seed=i, ignore_eos=True)
              for i in range(6)]
    results = []
    for tp in (1, 2):
        llm = LLM(str(llama_path), page_size=4, num_pages=48, decode_reserve_tokens=4, tp=tp)
        try:
            results.append([o.token_ids for o in llm.generate(prompts, params)])
            assert llm.stats.preemptions > 0
            llm.scheduler.check_integrity()
        finally:
            llm.close()
    assert results[0] == results[1]


def test_tp_aliases_and_a_follower_failure(llama_path: Path) -> None:
    """tp_size= is the config's name for tp=; a follower that dies makes the
    next generate raise, and close() still leaves nothing running."""
    with pytest.raises(ValueError, match="conflicting"):
        LLM(str(llama_path), tp=2, tp_size=1)
    llm = LLM(str(llama_path), tp_size=2, page_size=4)
    try:
        assert llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0)).pop().finish_reason == "length"
        leader = llm.scheduler.executor.leader
        (rank, follower), = leader.processes
        follower.kill()
        follower.wait(timeout=10)
        with pytest.raises(RuntimeError, match=f"rank {rank} exited"):
            for _ in range(50):  # the lifeline reports within moments
                llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
                time.sleep(0.1)
    finally:
        llm.close()
    assert follower.poll() is not None


def test_a_step_that_raises_on_either_rank_breaks_the_group(llama_path: Path, capfd: pytest.CaptureFixture) -> None:
    """A follower that raises exits with its reason; rank 0 hears of it at once.
    A step that raises on rank 0 fails the group too (ranks would diverge)."""
    from aioserve.placeholders import placeholder

    llm = LLM(str(llama_path), tp=2, page_size=4)
    try:
        llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
        leader = llm.scheduler.executor.leader
        (_, follower), = leader.processes
        # A plan naming a token its previous step never sampled: the follower
        # refuses it (PlaceholderError), as rank 0 would.
        bad = _one_token_plan(placeholder(5), step=10_000)
        leader.send(bad)
        assert follower.wait(timeout=10) == 1
        deadline = time.monotonic() + 5
        while llm.tp_failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.tp_failure == "rank 1 exited or became unreachable"
        assert "PlaceholderError" in capfd.readouterr().err
    finally:
        llm.close()

    llm = LLM(str(llama_path), tp=2, page_size=4)
    try:
        def broken(plan):
            raise RuntimeError("injected")

        llm.engine.forward = broken
        with pytest.raises(RuntimeError, match="step 0 raised on rank 0: RuntimeError\\('injected'\\)"):
            llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
        (_, follower), = llm.scheduler.executor.leader.processes
        assert follower.wait(timeout=10) == 1  # cut loose: it exits too
    finally:
        llm.close()


def _one_token_plan(token: int, step: int):
    from aioserve.batch_plan import BatchPlan

    one = torch.tensor([1])
    return BatchPlan(
        step=step, input_ids=torch.tensor([token]), positions=torch.tensor([0]), out_cache_loc=torch.tensor([4]),
        seq_lens=one, extend_lens=one, page_table=torch.tensor([[1]], dtype=torch.int32), num_decodes=0,
        logits_indices=torch.tensor([0]), sampling=None,
    )
