"""The CPU's native decode step (native/decoder.cpp's DecoderStack, run by
cpu_engine/decode_stack.py): decode-only steps through it give the same tokens
as through the modules, bit for bit, for every Llama-family layout (GQA,
sliding window, q/k/v bias, per-head q/k norms, tied embeddings), in float32
and bf16, at page sizes 1 and 4; and it stays out where it cannot be exact."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.cpu_engine.decode_stack import NativeDecodeRunner, unsupported_reason
from aioserve.cpu import elementwise as native_elementwise
from aioserve.cpu.dispatch import choose_cpu_dispatch
from aioserve.cpu.isa import cpu_flags
from aioserve.engine.dtypes import resolve_dtype
from aioserve.cpu.native import cpu_kernels
from hf_reference import hf_encode

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")

TEXTS = ["Once upon a time", "The cat sat on the", "1 2 3 4 5", "hello world " * 5, "a b c"]
BF16 = {"dtype": "bfloat16", "cpu_half_compute": "native"}


def _generate(model: Path, native: bool, params: SamplingParams, prompts: list[list[int]], **options) -> tuple:
    llm = LLM(str(model), debug_integrity=True, cuda_graph=native, **options)
    runner = llm.engine.graph_runner
    try:
        return [o.token_ids for o in llm.generate(prompts, params)], runner
    finally:
        llm.close()


@pytest.mark.parametrize(
    "arch,options",
    [
        ("llama", {"page_size": 1}),
        ("llama3-rope", {"page_size": 4}),  # GQA 8/2
        ("mistral", {"page_size": 4}),  # sliding window 24: the prompts run past it
        ("qwen2", {"page_size": 1, **BF16}),  # q/k/v bias, bf16 math
        ("qwen3", {"page_size": 4}),  # per-head q/k norms, tied embeddings
        ("qwen3", {"page_size": 4, **BF16}),
        ("llama", {"page_size": 4, "kv_cache_dtype": "bfloat16"}),  # a narrower cache under float32 math
    ],
)
def test_native_decode_matches_the_modules(
    tiny_checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture, arch: str, options: dict
) -> None:
    """Where this CPU's dispatch has the DecoderStack (not for half math on
    AMX, say), it runs the decodes; where not, the modules do and the log
    says why. The tokens are the modules' either way."""
    model = tiny_checkpoints[arch]
    prompts = [hf_encode(model, t) for t in TEXTS]
    dispatch = choose_cpu_dispatch(
        cpu_flags(), resolve_dtype(options.get("dtype", "auto"), "float32"),
        cpu_half_compute=options.get("cpu_half_compute", "auto"),
    )
    for params in (
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    ):
        for batch in (prompts[:1], prompts):
            eager, none = _generate(model, False, params, batch, **options)
            with caplog.at_level(logging.INFO, logger="aioserve.engine.loading"):
                native, runner = _generate(model, True, params, batch, **options)
            assert none is None
            if dispatch.native_decode:
                assert isinstance(runner, NativeDecodeRunner) and runner.replays > 0
            else:
                assert runner is None and f"decode modules: {dispatch.decode_reason}" in caplog.text
            assert native == eager


def test_native_decode_hidden_states_are_bit_identical(tiny_checkpoints: dict[str, Path]) -> None:
    """One decode step's final hidden states, through both paths, on one
    engine; and with an EAGLE-3 head's intermediate states after them."""
    llm = LLM(str(tiny_checkpoints["qwen3"]), page_size=4)
    try:
        engine = llm.engine
        runner = engine.graph_runner
        assert isinstance(runner, NativeDecodeRunner)
        llm.generate([hf_encode(tiny_checkpoints["qwen3"], TEXTS[3])], SamplingParams(max_tokens=2, temperature=0))
        from aioserve.batch_plan import BatchPlan

        # Three requests decoding at lengths 9, 13 and 5 over pages 1-6 (what the last call wrote, and fresh ones).
        plan = BatchPlan(
            step=0,
            input_ids=torch.tensor([5, 17, 3]),
            positions=torch.tensor([8, 12, 4]),
            out_cache_loc=torch.tensor([4 * 3 + 0, 4 * 5 + 0, 4 * 6 + 0]),
            seq_lens=torch.tensor([9, 13, 5]),
            extend_lens=torch.ones(3, dtype=torch.long),
            page_table=torch.tensor([[1, 2, 3, 0], [1, 2, 4, 5], [6, 6, 0, 0]], dtype=torch.int32),
            num_decodes=3,
            logits_indices=torch.arange(3),
            sampling=None,
        )
        with torch.inference_mode():
            modules = engine.model(plan.input_ids, plan.positions, engine.attention.prepare(plan, plan))
            native = runner.run(plan.input_ids, plan, plan)
        assert native.shape == modules.shape and torch.equal(native, modules)
        # With an EAGLE-3 head's states asked for (the embeddings, layer 1's
        # input twice): the same wide rows [3, 4 x hidden] from both paths.
        engine.model.capture_aux_hidden((0, 1, 1))
        with torch.inference_mode():
            modules = engine.model(plan.input_ids, plan.positions, engine.attention.prepare(plan, plan))
            native = runner.run(plan.input_ids, plan, plan)
        hidden = engine.model.config.hidden_size
        assert modules.shape == (3, 4 * hidden) and native.shape == modules.shape and torch.equal(native, modules)
        assert not torch.equal(native[:, hidden:2 * hidden], native[:, 2 * hidden:3 * hidden])
        assert torch.equal(native[:, 2 * hidden:3 * hidden], native[:, 3 * hidden:])
    finally:
        llm.close()


def test_native_decode_stays_out_where_it_cannot_run(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), page_size=4)
    try:
        model, device = llm.engine.model, llm.engine.device
        assert unsupported_reason(model, device) is None
        assert "not on a CPU" in (unsupported_reason(model, torch.device("meta")) or "")
        monkeypatch.setattr(native_elementwise, "ENABLED", False)
        assert "native kernels" in (unsupported_reason(model, device) or "")
        # Turned off mid-run, the modules serve the decodes (and still agree).
        runner = llm.engine.graph_runner
        before = runner.replays
        out = llm.generate([hf_encode(tiny_checkpoints["llama"], TEXTS[0])], SamplingParams(max_tokens=5, temperature=0))
        assert runner.replays == before and len(out[0].token_ids) == 5
    finally:
        llm.close()
