"""Verify graphs (engine/verify_graph.py) on CPU: the padding of a
speculating step to a captured size, and whole speculative runs through the
FlashInfer backend against the enforcing fake (tests/fake_flashinfer.py,
which holds a graph-mode prefill wrapper to FlashInfer's rules: a fixed
request count, never more rows than the capture's, NaN in rows a plan
leaves) with EagerCapture, whose replays rerun the captured step over the
runner's static buffers: a buffer not refreshed shows up as wrong tokens
here. Outputs must equal plain decoding on the torch backend. The real
kernels run in tests/test_speculative.py's GPU test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.attention.flashinfer import FlashInferBackend
from aioserve.batch_plan import BatchPlan
from aioserve.engine.cuda_graph import SCRATCH_SLOT, EagerCapture
from aioserve.engine.verify_graph import pad_verify_plan, verify_rows
from fake_flashinfer import KernelFault, fake_flashinfer
from hf_reference import hf_encode
from test_speculative import NGRAM, TEXTS, OracleProposer, same_outputs
from tiny_models import build_checkpoint


def _step(extend_lens: list[int], seq_lens: list[int]) -> BatchPlan:
    """Decodes first (extend 1), then extends; rows numbered from 10."""
    t = sum(extend_lens)
    n = len(extend_lens)
    return BatchPlan(
        step=3, input_ids=torch.arange(10, 10 + t), positions=torch.arange(20, 20 + t),
        out_cache_loc=torch.arange(40, 40 + t), seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend_lens), page_table=torch.arange(1, 1 + 2 * n, dtype=torch.int32).view(n, 2),
        num_decodes=sum(1 for e in extend_lens if e == 1), logits_indices=torch.arange(t), sampling=None,
    )


def test_padding_keeps_the_rows_and_gives_the_rest_to_padding_requests() -> None:
    plan = _step([1, 5, 3], [7, 12, 9])  # a decode, a full verification (k = 4), a shorter one
    padded = pad_verify_plan(plan, 4, 5, page_size=4)
    rows = verify_rows(4, 5)
    assert rows == 21 and padded.num_tokens == rows and padded.num_requests == 5 and padded.num_decodes == 0
    assert padded.input_ids[:9].tolist() == list(range(10, 19)) and padded.input_ids[9:].eq(0).all()
    assert padded.positions[9:].eq(0).all() and padded.out_cache_loc[9:].eq(SCRATCH_SLOT).all()
    # one single-row padding request, then the last takes what is left: 21 - 9 - 1
    assert padded.extend_lens.tolist() == [1, 5, 3, 1, 11] and padded.seq_lens.tolist() == [7, 12, 9, 1, 11]
    assert padded.page_table.shape == (5, 3) and torch.equal(padded.page_table[:3, :2], plan.page_table)
    assert padded.page_table[3:].eq(0).all() and padded.page_table[:3, 2:].eq(0).all()
    assert padded.sampling is None and padded.step == plan.step
    # a full batch still has its last padding request (one row)
    full = pad_verify_plan(_step([5, 5], [8, 8]), 2, 5, page_size=16)
    assert full.extend_lens.tolist() == [5, 5, 1] and full.num_tokens == verify_rows(2, 5)
    with pytest.raises(ValueError, match="do not fit"):
        pad_verify_plan(plan, 2, 5, page_size=4)
    with pytest.raises(ValueError, match="more than 4"):
        pad_verify_plan(plan, 4, 4, page_size=4)


def test_the_fake_holds_a_graph_prefill_to_flashinfers_rules() -> None:
    """What the runner relies on: the rows planned at capture bound every
    later plan, and the request count is fixed."""
    buffers = dict(qo_indptr_buf=torch.zeros(3, dtype=torch.int32), paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32),
                   paged_kv_indices_buf=torch.zeros(8, dtype=torch.int32),
                   paged_kv_last_page_len_buf=torch.zeros(2, dtype=torch.int32))
    wrapper = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper(None, "NHD", use_cuda_graph=True, **buffers)
    i32 = dict(dtype=torch.int32)

    def plan(qo: list[int], pages: int = 2) -> None:
        wrapper.plan(torch.tensor(qo, **i32), torch.tensor([0, 1, pages], **i32), torch.arange(pages, **i32),
                     torch.tensor([qo[1], qo[2] - qo[1]], **i32), 4, 2, 64, 16, causal=True)

    plan([0, 2, 6])
    plan([0, 1, 5])  # fewer rows: allowed
    with pytest.raises(KernelFault, match="exceed"):
        plan([0, 4, 7])
    with pytest.raises(KernelFault, match="batch size is fixed"):
        wrapper.plan(torch.tensor([0, 6], **i32), torch.tensor([0, 1], **i32), torch.arange(1, **i32),
                     torch.tensor([6], **i32), 4, 2, 64, 16, causal=True)
    with pytest.raises(KernelFault, match="exceed the buffer"):
        plan([0, 1, 5], pages=9)


@pytest.fixture(scope="module")
def qwen3_hd64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head dim the fake (like FlashInfer) has a kernel for."""
    return build_checkpoint("qwen3", tmp_path_factory.mktemp("verify") / "qwen3", overrides={"head_dim": 64})


def _plain(model: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """The reference: the torch backend, no speculation, no graphs."""
    llm = LLM(str(model), debug_integrity=True, cuda_graph=False, dtype="float32", page_size=4)
    try:
        return [(o.token_ids, o.logprobs, o.finish_reason) for o in llm.generate(prompts, params)]
    finally:
        llm.close()


@pytest.mark.parametrize("corrupt", [0, 3], ids=["every-proposal-right", "every-third-wrong"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_verify_graphs_give_plain_decodings_outputs(qwen3_hd64: Path, corrupt: int, sampling: str) -> None:
    model = qwen3_hd64
    prompts = [hf_encode(model, t) for t in TEXTS]
    # Lengths that differ: the running requests go 4, 3, 2, 1 (10 to 40 tokens), so steps of 4
    # run eagerly (graphs up to 3) and the rest replay graphs of 3, 2 and 1.
    if sampling == "greedy":
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (10, 20, 30, 40)]
    else:
        params = [SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=1)
                  for n in (10, 20, 30, 40)]
    plain = _plain(model, prompts, params)
    expected = {tuple(p): out[0] for p, out in zip(prompts, plain)}
    spec = {**NGRAM, "disable_by_batch_size": 4}
    llm = LLM(str(model), debug_integrity=True, cuda_graph=False, dtype="float32", page_size=4,
              speculative_config=spec, cuda_graph_max_bs=3)
    engine = llm.engine
    try:
        engine.attention = FlashInferBackend(engine.pool, engine.attention_shape, fake_flashinfer)
        engine.graph_runner = engine.capture_decode_graphs(EagerCapture())
        runner = engine.verify_graph_runner = engine.capture_verify_graphs(EagerCapture())
        assert runner is not None and runner.batch_sizes == [1, 2, 3] and runner.tokens_per_request == 5
        llm.scheduler.speculator.proposer = OracleProposer(expected, corrupt)
        outs = llm.generate(prompts, params)
        speculative = [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]
        llm.scheduler.check_integrity()
        stats, replays = llm.scheduler.speculator.stats, runner.replays
        # one request alone as well: every verification a replay of the smallest graph
        alone = [(o.token_ids, o.logprobs, o.finish_reason) for o in llm.generate(prompts[3:], params[3:])]
    finally:
        llm.close()
    assert same_outputs(speculative, plain)
    assert same_outputs(alone, plain[3:])
    assert replays > 0 and runner.replays > replays and stats.accepted_tokens > 0
    if corrupt:
        assert stats.accepted_tokens < stats.draft_tokens


def test_without_speculation_no_verify_graphs_are_captured(qwen3_hd64: Path) -> None:
    llm = LLM(str(qwen3_hd64), cuda_graph=False, dtype="float32", page_size=4)
    try:
        llm.engine.attention = FlashInferBackend(llm.engine.pool, llm.engine.attention_shape, fake_flashinfer)
        assert llm.engine.capture_verify_graphs(EagerCapture()) is None
    finally:
        llm.close()


def test_a_failed_capture_leaves_speculation_eager_and_right(qwen3_hd64: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A capture that raises (a kernel the capture refuses) must not stop the
    server: the verifications run eagerly, the outputs stay plain decoding's."""
    from aioserve.engine import engine as engine_module

    prompts = [hf_encode(qwen3_hd64, t) for t in TEXTS]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * len(prompts)
    plain = _plain(qwen3_hd64, prompts, params)

    def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine_module, "VerifyGraphRunner", refused)
    llm = LLM(str(qwen3_hd64), debug_integrity=True, cuda_graph=False, dtype="float32", page_size=4,
              speculative_config=NGRAM)
    try:
        engine = llm.engine
        engine.attention = FlashInferBackend(engine.pool, engine.attention_shape, fake_flashinfer)
        engine.graph_runner = engine.capture_decode_graphs(EagerCapture())
        with caplog.at_level("ERROR"):
            engine.capture_speculation_graphs(EagerCapture())
        assert engine.verify_graph_runner is None and "verify graphs not captured" in caplog.text
        outs = [(o.token_ids, o.logprobs, o.finish_reason) for o in llm.generate(prompts, params)]
        assert llm.scheduler.speculator.stats.drafts > 0
    finally:
        llm.close()
    assert [o[0] for o in outs] == [p[0] for p in plain]
