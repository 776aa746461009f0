"""The decode graph runner's seams on CPU: batch-size buckets, padding, and
"graphs on vs off" through the LLM API with EagerCapture, whose replay
reruns the captured step over the runner's static buffers, so a buffer the
runner forgot to refresh shows up as wrong tokens here, not on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.batch_plan import BatchPlan
from aioserve.engine.cuda_graph import (
    SCRATCH_SLOT,
    EagerCapture,
    graph_batch_sizes,
    pad_decode_plan,
    padded_size,
)
from aioserve.engine.loading import kv_budget_bytes
from aioserve.cpu import elementwise as native_elementwise
from aioserve.cpu.native import cpu_kernels
from hf_reference import hf_encode

TEXTS = ["Once upon a time", "The cat sat on the", "1 2 3 4 5", "hello world " * 5, "a b c"]


def test_batch_sizes_are_1_2_4_8_then_every_8() -> None:
    assert graph_batch_sizes(256)[:7] == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padded_size_is_the_next_captured_size() -> None:
    sizes = graph_batch_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 16, 20, 20, None]


def _decode_plan(n: int) -> BatchPlan:
    long = torch.long
    return BatchPlan(
        step=7,
        input_ids=torch.arange(10, 10 + n),
        positions=torch.arange(20, 20 + n),
        out_cache_loc=torch.arange(40, 40 + n),
        seq_lens=torch.arange(21, 21 + n),
        extend_lens=torch.ones(n, dtype=long),
        page_table=torch.arange(1, 1 + 3 * n, dtype=torch.int32).view(n, 3),
        num_decodes=n,
        logits_indices=torch.arange(n),
        sampling=None,
    )


def test_padding_adds_dummy_requests_in_the_reserved_page() -> None:
    plan = _decode_plan(3)
    padded = pad_decode_plan(plan, 8)
    assert padded.num_requests == padded.num_decodes == padded.num_tokens == 8 and padded.is_decode_only
    assert padded.input_ids[:3].tolist() == [10, 11, 12] and padded.input_ids[3:].eq(0).all()
    assert padded.positions[3:].eq(0).all() and padded.out_cache_loc[3:].eq(SCRATCH_SLOT).all()
    assert padded.seq_lens[3:].eq(1).all() and padded.page_table[3:].eq(0).all()
    assert torch.equal(padded.page_table[:3], plan.page_table) and padded.page_table.dtype == torch.int32
    assert padded.sampling is None and padded.step == plan.step
    with pytest.raises(ValueError):
        pad_decode_plan(plan, 2)


def test_kv_budget_is_the_static_share_less_what_is_in_use() -> None:
    gib = 1 << 30
    assert kv_budget_bytes(80 * gib, 78 * gib, 0.85) == int(80 * gib * 0.85) - 2 * gib
    assert kv_budget_bytes(80 * gib, 10 * gib, 0.5) == 0  # the weights alone exceed the share
    with pytest.raises(ValueError):
        kv_budget_bytes(80 * gib, 78 * gib, 1.5)


needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")


def _generate(model: Path, graphs: bool, params: SamplingParams, prompts: list[list[int]], **options) -> tuple:
    # cuda_graph=False: eager means the modules (not the CPU's native decode step).
    llm = LLM(str(model), debug_integrity=True, cuda_graph=False, **options)
    runner = None
    if graphs:
        runner = llm.engine.graph_runner = llm.engine.capture_decode_graphs(EagerCapture())
    try:
        return [o.token_ids for o in llm.generate(prompts, params)], runner
    finally:
        llm.close()


@needs_kernels
@pytest.mark.parametrize("fused", [True, False], ids=["native-elementwise", "torch-elementwise"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ["llama3-rope", "mistral"])  # mistral: GQA and a sliding window
def test_graph_replay_matches_eager(
    tiny_checkpoints: dict[str, Path], arch: str, page_size: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The torch twins are what CUDA runs: their per-step caches (RoPE's
    # cos/sin rows) must be rebuilt inside a capture, not reused from warm-up.
    monkeypatch.setattr(native_elementwise, "ENABLED", fused)
    model = tiny_checkpoints[arch]
    prompts = [hf_encode(model, t) for t in TEXTS]
    options = dict(page_size=page_size, max_running_requests=8, cuda_graph_max_bs=6)
    for params in (
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    ):
        for batch in (prompts[:1], prompts[:3], prompts):  # 1, 3 -> 4, 5 -> 6 rows
            eager, _ = _generate(model, False, params, batch, **options)
            replayed, runner = _generate(model, True, params, batch, **options)
            assert replayed == eager
            assert runner.batch_sizes == [1, 2, 4, 6] and runner.replays > 0
