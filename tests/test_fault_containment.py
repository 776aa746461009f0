"""Faults end requests, never the scheduler (issue 14): a forward that
raises fails the requests of its step and frees what they held; non-finite
logits end only their own request; a failed KV integrity check fails what
runs, resets the bookkeeping and keeps serving; a consumer that raises ends
only its own request. Nothing here may hang: every loop is awaited with a
timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.config import EngineConfig
from aioserve.engine.engine import Engine
from aioserve.engine.executor import ThreadExecutor
from aioserve.scheduler import Request, RequestEvent, Scheduler
from aioserve.launch.wiring import model_facts
from aioserve.scheduler.output_processor import OutputProcessor

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TIMEOUT = 120


def new_scheduler(path: Path, **options) -> tuple[Engine, Scheduler]:
    config = EngineConfig(model=str(path), page_size=4, **options)
    engine = Engine(config)
    return engine, Scheduler(config, model_facts(engine), ThreadExecutor(engine))


def submit(scheduler: Scheduler, events: dict[str, list[RequestEvent]], rid: str, prompt: list[int],
           params: SamplingParams = GREEDY) -> None:
    events[rid] = []
    scheduler.submit(Request(rid, prompt, params, events[rid].append))


def run_until_idle(scheduler: Scheduler) -> None:
    asyncio.run(asyncio.wait_for(scheduler.run(until_idle=True), TIMEOUT))


def tokens(events: list[RequestEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def assert_pool_whole(scheduler: Scheduler) -> None:
    """Integrity holds, nothing runs, every page is free or evictable."""
    scheduler.check_integrity()
    info = scheduler.info(check_integrity=True)
    assert info.kv_integrity == "ok" and info.running == info.waiting == 0
    assert info.kv_pages_free + info.kv_pages_evictable == info.kv_pages_total


def fail_forward_once(engine: Engine, call: int, exc: Exception) -> list[int]:
    """Make the model's `call`-th forward (0-based) raise `exc`; returns the calls seen."""
    calls: list[int] = []
    forward = engine.model.forward

    def failing(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) - 1 == call:
            raise exc
        return forward(*args, **kwargs)

    engine.model.forward = failing  # nn.Module.__call__ finds the instance attribute first
    runner = engine.graph_runner  # decode-only steps on CPU: the native DecoderStack, not model.forward
    if runner is not None:
        run = runner.run

        def failing_run(*args, **kwargs):
            calls.append(len(calls))
            if len(calls) - 1 == call:
                raise exc
            return run(*args, **kwargs)

        runner.run = failing_run  # type: ignore[method-assign]
    return calls


# -- a forward that raises ------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_forward_fails_its_step_only_and_frees_what_it_held(llama_path: Path, overlap: bool) -> None:
    """`a` prefills alone in step 0 (the prefill budget is its prompt), whose
    forward raises; `b` is admitted in step 1, which with overlap is already
    launched, its plan naming step 0's token for `a`. `a` ends with the
    error; `b` and a later request run as if nothing happened."""
    _, reference = new_scheduler(llama_path)
    ref_events: dict[str, list[RequestEvent]] = {}
    submit(reference, ref_events, "b", [9, 10, 11, 12])
    submit(reference, ref_events, "c", [5, 6, 7])
    run_until_idle(reference)
    reference.shutdown()

    engine, scheduler = new_scheduler(llama_path, overlap=overlap, max_prefill_tokens=8)
    fail_forward_once(engine, 0, RuntimeError("injected forward failure"))
    events: dict[str, list[RequestEvent]] = {}
    submit(scheduler, events, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    submit(scheduler, events, "b", [9, 10, 11, 12])
    try:
        run_until_idle(scheduler)
        assert [e.finish_reason for e in events["a"]] == ["error"]
        assert "forward failed" in events["a"][0].error and "injected forward failure" in events["a"][0].error
        assert tokens(events["b"]) == tokens(ref_events["b"]) and events["b"][-1].finish_reason == "length"
        assert_pool_whole(scheduler)
        submit(scheduler, events, "c", [5, 6, 7])
        run_until_idle(scheduler)
        assert tokens(events["c"]) == tokens(ref_events["c"])
        assert_pool_whole(scheduler)
    finally:
        scheduler.shutdown()


def test_a_failed_decode_step_through_the_offline_api(stories_path: Path) -> None:
    llm = LLM(str(stories_path), page_size=4, debug_integrity=True)
    try:
        prompts = ["Once upon a time", "The little dog"]
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        fail_forward_once(llm.engine, 4, ValueError("boom"))  # a decode step of both
        failed = llm.generate(prompts, GREEDY)
        assert [o.finish_reason for o in failed] == ["error", "error"]
        llm.scheduler.check_integrity()
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        info = llm.scheduler.info(check_integrity=True)
        assert info.kv_integrity == "ok" and info.kv_pages_free + info.kv_pages_evictable == info.kv_pages_total
    finally:
        llm.close()


# -- non-finite logits ------------------------------------------------------------------


def b_alone(llama_path: Path) -> list[RequestEvent]:
    """Request `b`'s events when it runs by itself."""
    _, reference = new_scheduler(llama_path)
    events: dict[str, list[RequestEvent]] = {}
    submit(reference, events, "b", [9, 10, 11])
    run_until_idle(reference)
    reference.shutdown()
    return events["b"]


def third_two_row_step(poison: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """`poison` applied to the rows of the third step that samples two rows."""
    two_row_steps: list[int] = []

    def maybe(rows: torch.Tensor) -> None:
        if rows.shape[0] == 2:
            two_row_steps.append(1)
            if len(two_row_steps) == 3:
                poison(rows)

    return maybe


def assert_only_a_fails(scheduler: Scheduler, b_reference: list[RequestEvent]) -> None:
    """`a` (admitted first, so row 0 among the decodes) ends with an error
    after two tokens; `b`, sampled in the same steps, gets exactly its tokens."""
    events: dict[str, list[RequestEvent]] = {}
    submit(scheduler, events, "a", [5, 6, 7, 8])
    submit(scheduler, events, "b", [9, 10, 11])
    try:
        run_until_idle(scheduler)
        a, b = events["a"], events["b"]
        assert len(tokens(a)) == 2 and a[-1].finish_reason == "error" and a[-1].token_id is None
        assert "logits were not finite" in a[-1].error
        assert tokens(b) == tokens(b_reference) and b[-1].finish_reason == "length"
        assert_pool_whole(scheduler)
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_end_only_their_request(llama_path: Path, bad: float) -> None:
    """Row 0 of the third two-row sampling step gets one bad logit."""
    reference = b_alone(llama_path)
    engine, scheduler = new_scheduler(llama_path)
    # The bad logit is injected into the full logits: greedy rows must not
    # take the screen's shortcut past them (the next test covers the screen).
    engine.greedy_screen = None
    compute_logits = engine.model.compute_logits
    poison = third_two_row_step(lambda logits: logits[0].index_fill_(0, torch.tensor([17]), bad))

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        poison(logits)
        return logits

    engine.model.compute_logits = poisoned
    assert_only_a_fails(scheduler, reference)


def test_a_non_finite_hidden_row_under_the_greedy_screen_ends_only_its_request(llama_path: Path) -> None:
    """The screen hands a step with a NaN hidden row back to the full
    logits, where the sampler ends that row's request as above."""
    reference = b_alone(llama_path)
    engine, scheduler = new_scheduler(llama_path)
    screen = engine.greedy_screen
    if screen is None:
        pytest.skip("no greedy screen here (native kernels not built)")
    screened = screen.argmax
    poison = third_two_row_step(lambda hidden: hidden[0].index_fill_(0, torch.tensor([3]), float("nan")))

    def poisoned(hidden: torch.Tensor) -> torch.Tensor | None:
        poison(hidden)
        return screened(hidden)

    screen.argmax = poisoned  # type: ignore[method-assign]
    assert_only_a_fails(scheduler, reference)


# -- KV integrity -------------------------------------------------------------------


def test_a_failed_idle_integrity_check_resets_and_keeps_serving(stories_path: Path) -> None:
    """The loop as the server runs it (never idle-exits). A page lost from
    the bookkeeping makes the idle check fail: it used to raise out of the
    loop, and every later request waited forever."""
    _, scheduler = new_scheduler(stories_path, debug_integrity=True)
    events: dict[str, list[RequestEvent]] = {}

    async def serve() -> None:
        loop_task = asyncio.create_task(scheduler.run())
        try:
            submit(scheduler, events, "first", [5, 6, 7])
            await wait_finished(events, "first")
            scheduler.kv.allocator.alloc(1)  # a page now belongs to nobody
            submit(scheduler, events, "second", [5, 6, 7])
            await wait_finished(events, "second")
            for _ in range(100):  # the loop goes idle, checks, resets
                if scheduler.integrity_failures:
                    break
                await asyncio.sleep(0.05)
            submit(scheduler, events, "third", [5, 6, 7])
            await wait_finished(events, "third")
            assert not loop_task.done()
        finally:
            scheduler.stop()
            await asyncio.wait_for(loop_task, TIMEOUT)

    try:
        asyncio.run(asyncio.wait_for(serve(), TIMEOUT))
        assert len(scheduler.integrity_failures) == 1 and "1 lost" in scheduler.integrity_failures[0]
        assert tokens(events["third"]) == tokens(events["first"]) == tokens(events["second"])
        scheduler.check_integrity()  # the fresh bookkeeping
        assert scheduler.info(check_integrity=True).kv_integrity.startswith("reset after a failed check")
    finally:
        scheduler.shutdown()


async def wait_finished(events: dict[str, list[RequestEvent]], rid: str) -> None:
    for _ in range(TIMEOUT * 20):
        if events[rid] and events[rid][-1].finish_reason is not None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"request {rid} never finished")


def test_the_offline_api_raises_on_a_failed_integrity_check_and_recovers(stories_path: Path) -> None:
    llm = LLM(str(stories_path), page_size=4, debug_integrity=True)
    try:
        expected = llm.generate("Once upon a time", GREEDY)[0].token_ids
        cached = llm.scheduler.kv.cache.all_pages()[0]
        llm.scheduler.kv.allocator.free([cached])  # a cached page is also free now
        with pytest.raises(RuntimeError, match="KV integrity check failed"):
            llm.generate("The cat", GREEDY)
        llm.scheduler.check_integrity()
        assert llm.generate("Once upon a time", GREEDY)[0].token_ids == expected
    finally:
        llm.close()


def test_a_bug_that_breaks_the_bookkeeping_fails_the_running_requests_and_resets(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processing a step raises after corrupting the KV state (a page of a
    running request handed back to the free list): every request ends with
    an error, the check that follows finds the damage and resets, and the
    next request is served."""
    _, scheduler = new_scheduler(llama_path)
    accept = OutputProcessor._accept
    calls: list[int] = []

    def buggy(self, request, row, host):
        calls.append(1)
        if len(calls) == 5:
            self.table.kv.allocator.free(request.kv.own_pages[:1])
            raise RuntimeError("bug")
        return accept(self, request, row, host)

    monkeypatch.setattr(OutputProcessor, "_accept", buggy)
    events: dict[str, list[RequestEvent]] = {}
    submit(scheduler, events, "a", [5, 6, 7, 8])
    submit(scheduler, events, "b", [9, 10, 11])
    try:
        run_until_idle(scheduler)
        for rid in ("a", "b"):
            assert events[rid][-1].finish_reason == "error" and events[rid][-1].error == "internal scheduler error"
        assert len(scheduler.integrity_failures) == 1
        monkeypatch.setattr(OutputProcessor, "_accept", accept)
        submit(scheduler, events, "c", [5, 6, 7, 8])
        run_until_idle(scheduler)
        assert len(tokens(events["c"])) == 8 and events["c"][-1].finish_reason == "length"
        scheduler.check_integrity()
    finally:
        scheduler.shutdown()


# -- a consumer that raises -----------------------------------------------------------


def test_a_consumer_that_raises_ends_only_its_request(llama_path: Path) -> None:
    """Its sink raises on the first event: the request ends with an error
    (the end is delivered too; a second raise there changes nothing) and the
    other request runs to its end."""
    _, scheduler = new_scheduler(llama_path)
    heard: list[RequestEvent] = []

    def bad_sink(event: RequestEvent) -> None:
        heard.append(event)
        raise ValueError("consumer bug")

    events: dict[str, list[RequestEvent]] = {}
    scheduler.submit(Request("bad", [5, 6, 7], GREEDY, bad_sink))
    submit(scheduler, events, "good", [9, 10, 11])
    try:
        run_until_idle(scheduler)
        assert len(heard) == 2 and heard[-1].finish_reason == "error" and heard[-1].error == "the consumer failed"
        assert len(tokens(events["good"])) == 8 and events["good"][-1].finish_reason == "length"
        assert_pool_whole(scheduler)
    finally:
        scheduler.shutdown()
