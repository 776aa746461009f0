"""The scheduler's core contracts: a request bounded by the KV pool cannot
wedge the queue, a failing consumer fails only its request, placeholders
name real rows or raise, and max_tokens 0 scores the prompt only."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.config import EngineConfig
from aioserve.engine.engine import Engine
from aioserve.engine.executor import ThreadExecutor
from aioserve.placeholders import PlaceholderError, PreviousStepTokens, placeholder
from aioserve.scheduler import Request, RequestEvent, Scheduler
from aioserve.launch.wiring import model_facts


def run_scheduler(config: EngineConfig, requests: list[tuple[str, list[int], SamplingParams]], sink_for=None):
    """Run `requests` to the end on a fresh scheduler; events by request id."""
    engine = Engine(config)
    scheduler = Scheduler(config, model_facts(engine), ThreadExecutor(engine))
    events: dict[str, list[RequestEvent]] = {}
    for rid, prompt, params in requests:
        events[rid] = []
        sink = (sink_for or (lambda rid: events[rid].append))(rid)
        scheduler.submit(Request(rid, prompt, params, sink))
    asyncio.run(scheduler.run(until_idle=True))
    scheduler.check_integrity()
    info = scheduler.info(check_integrity=True)
    scheduler.shutdown()
    return events, info


def test_a_request_longer_than_the_pool_ends_with_length_and_the_queue_moves(stories_path: Path) -> None:
    """20 pages of 4 tokens (19 usable: 76 tokens). A short prompt asking for
    200 tokens used to outgrow the pool, preempt itself and never be
    readmitted, and every later request waited forever. Now it is bounded
    by the pool and ends with `length`; the request sent meanwhile is served."""
    llm = LLM(str(stories_path), page_size=4, num_pages=20, debug_integrity=True)
    try:
        capacity = 19 * 4
        prompt = llm.encode("Once upon a time")
        assert llm.scheduler.validate(len(prompt), 200) == capacity - len(prompt)
        assert llm.scheduler.validate(len(prompt), None) == capacity - len(prompt)  # chat without max_tokens
        big, small = llm.generate(
            [prompt, "The cat"],
            [SamplingParams(max_tokens=200, ignore_eos=True, temperature=0),
             SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)],
        )
        assert big.finish_reason == "length" and len(big.token_ids) == capacity - len(prompt)
        assert small.finish_reason == "length" and len(small.token_ids) == 8
        llm.scheduler.check_integrity()
        info = llm.scheduler.info()
        assert info.kv_pages_free + info.kv_pages_evictable == info.kv_pages_total
    finally:
        llm.close()


def test_the_oversized_request_does_not_block_one_sent_meanwhile_over_http(stories_path: Path) -> None:
    import httpx

    from server_harness import start_server

    server = start_server(stories_path, "--page-size", "4", "--num-pages", "20", "--debug-integrity")
    try:
        results: dict[str, dict] = {}

        def ask(name: str, max_tokens: int) -> None:
            body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            results[name] = httpx.post(f"{server.v1}/completions", json=body, timeout=120).json()

        big = threading.Thread(target=ask, args=("big", 200))
        big.start()
        ask("second", 5)  # sent while the big one runs
        big.join(timeout=120)
        assert results["second"]["choices"][0]["finish_reason"] == "length"
        assert results["second"]["usage"]["completion_tokens"] == 5
        assert results["big"]["choices"][0]["finish_reason"] == "length"
        usage = results["big"]["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 19 * 4
        info = server.wait_idle()
        assert info["kv_integrity"] == "ok"
    finally:
        server.stop()


def test_a_failing_consumer_fails_only_its_request(llama_path: Path) -> None:
    config = EngineConfig(model=str(llama_path), page_size=4, debug_integrity=True)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
    seen: dict[str, list[RequestEvent]] = {"good": [], "bad": []}

    def sink_for(rid: str):
        def sink(event: RequestEvent) -> None:
            seen[rid].append(event)
            if rid == "bad" and len(seen[rid]) == 3:
                raise ValueError("consumer bug")

        return sink

    _, info = run_scheduler(
        config, [("good", [5, 6, 7, 8], params), ("bad", [9, 10, 11], params)], sink_for=sink_for
    )
    good, bad = seen["good"], seen["bad"]
    assert [e.token_id is not None for e in good] == [True] * 10 and good[-1].finish_reason == "length"
    assert len(bad) == 4 and bad[-1].finish_reason == "error" and bad[-1].error == "the consumer failed"
    assert info.running == info.waiting == 0 and info.kv_integrity == "ok"
    assert info.kv_pages_free + info.kv_pages_evictable == info.kv_pages_total


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(stories_path: Path) -> None:
    llm = LLM(str(stories_path), page_size=4, debug_integrity=True)
    try:
        prompt = "Once upon a time there was"
        scored, reference = llm.generate(
            [prompt, prompt],
            [SamplingParams(max_tokens=0, prompt_logprobs=2), SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0)],
        )
        assert scored.finish_reason == "length" and scored.token_ids == [] and scored.text == ""
        assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
        assert scored.prompt_logprobs[0] is None
        for mine, theirs in zip(scored.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
            assert mine[0] == pytest.approx(theirs[0], abs=1e-5)
            assert [t for t, _ in mine[1]] == [t for t, _ in theirs[1]]
        plain = llm.generate(prompt, SamplingParams(max_tokens=0))[0]
        assert plain.finish_reason == "length" and plain.token_ids == []
        llm.scheduler.check_integrity()
    finally:
        llm.close()


def test_placeholders_name_rows_of_the_previous_step_or_raise() -> None:
    previous = PreviousStepTokens(torch.device("cpu"))
    previous.record(4, torch.tensor([11, 22, 33]))
    ids = torch.tensor([7, placeholder(2), placeholder(0)])
    assert previous.resolve(5, ids, ids).tolist() == [7, 33, 11]
    plain = torch.tensor([1, 2])
    assert previous.resolve(9, plain, plain) is plain  # no placeholders: any step
    with pytest.raises(PlaceholderError, match="row 3"):
        bad = torch.tensor([placeholder(3)])
        previous.resolve(5, bad, bad)  # used to be clamped to row 2's token
    with pytest.raises(PlaceholderError, match="last step run was 4"):
        stale = torch.tensor([placeholder(0)])
        previous.resolve(6, stale, stale)


def test_the_engine_refuses_a_plan_naming_a_missing_row(llama_path: Path) -> None:
    config = EngineConfig(model=str(llama_path), page_size=4)
    engine = Engine(config)
    scheduler = Scheduler(config, model_facts(engine), ThreadExecutor(engine))
    scheduler.submit(Request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), lambda event: None))
    first = scheduler.schedule()
    assert first is not None
    engine.forward(first.plan)  # samples one row
    second = scheduler.schedule()  # overlap: the decode names row 0 of step 0
    assert second is not None and second.plan.input_ids.tolist() == [placeholder(0)]
    second.plan.input_ids[0] = placeholder(1)
    with pytest.raises(PlaceholderError, match="row 1"):
        engine.forward(second.plan)
    scheduler.shutdown()
