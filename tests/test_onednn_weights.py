"""Weights reordered once for oneDNN (cpu/onednn_weights.py): forced
(--cpu-matmul onednn) on any CPU, float32 greedy equals transformers through
the reordered weights (a tied embedding keeps its plain copy beside the
head's reordered one); half weights take the path where oneDNN can reorder
them here (AMX and AVX-512 machines) and otherwise fall back to BLAS forms,
logged, with the same tokens; timed beside the BLAS forms (the default for
half math on AMX), the layout is kept for the weight shapes it wins; a
layout whose products disagree with torch's is refused before any weight
changes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import aioserve.cpu.onednn_weights as onednn_weights
from aioserve import LLM, SamplingParams
from aioserve.cpu.dispatch import PERSONALITIES, choose_cpu_dispatch
from aioserve.cpu.matmul import MatmulChoice
from aioserve.layers.linear import QuantizableLinear
from hf_reference import hf_encode
from test_greedy_matches_hf import PROMPTS, check_against_hf


def onednn_reorders(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN reorders weights of `dtype` (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        onednn_weights.onednn_reorder(torch.ones(8, 8, dtype=dtype))
        return True
    except RuntimeError:
        return False


def _linears(llm: LLM) -> list[QuantizableLinear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, QuantizableLinear)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_through_reordered_weights_equals_transformers(
    arch: str, tiny_checkpoints: dict[str, Path]
) -> None:
    path = tiny_checkpoints[arch]
    llm = LLM(str(path), page_size=4, device="cpu", cpu_matmul="onednn")
    try:
        assert llm.engine.cpu_dispatch.onednn == "always" and not llm.engine.cpu_dispatch.packed_matmul
        for module in _linears(llm):  # each projection reads its reordered weight; no plain copy is left
            assert module.matmul_choice is not None and module.matmul_choice.onednn_weight is module.weight
            assert module.weight.is_mkldnn and "weight" not in module._parameters
        head = llm.engine.model.lm_head
        assert head.matmul_choice is not None and head.matmul_choice.onednn_weight is not None
        if arch == "qwen3":  # tied: the embedding's plain rows stay, the head multiplies a reordered copy
            assert head.weight is llm.engine.model.model.embed_tokens.weight and not head.weight.is_mkldnn
        check_against_hf(path, llm, [hf_encode(path, p) for p in PROMPTS[:3]])
    finally:
        llm.close()


def test_half_weights_reorder_where_onednn_can_else_blas(
    tiny_checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """bfloat16 weights and math, oneDNN forced: reordered where this CPU's
    oneDNN can (AMX, AVX-512), else refused with the reason logged and the
    BLAS forms tuned; either way the tokens are the BLAS path's."""
    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [hf_encode(path, p) for p in PROMPTS[:2]]
    runs = {}
    for matmul in ("blas", "onednn"):
        with caplog.at_level(logging.WARNING, logger="aioserve.cpu_engine.fast_paths"):
            llm = LLM(str(path), page_size=4, device="cpu", dtype="bfloat16", cpu_half_compute="native",
                      cpu_matmul=matmul)
        try:
            choices = [m.matmul_choice for m in _linears(llm)]
            if matmul == "onednn" and onednn_reorders(torch.bfloat16):
                assert all(c is not None and c.onednn_weight is not None for c in choices)
            else:
                assert all(c is not None and c.onednn_weight is None and c.forms for c in choices)
            runs[matmul] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    if not onednn_reorders(torch.bfloat16):
        assert "oneDNN's weight layout refused, BLAS forms instead: oneDNN cannot reorder" in caplog.text
    assert runs["onednn"] == runs["blas"]


def test_a_layout_that_disagrees_with_torch_is_refused_whole(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One weight whose reordered products are wrong: no module is changed
    (every weight still a plain parameter), the BLAS forms are tuned, and the
    outputs are the plain path's."""
    real = onednn_weights.onednn_reorder
    calls = []

    def wrong_once(weight: torch.Tensor) -> torch.Tensor:
        calls.append(weight.shape)
        return real(weight * 1.5 if len(calls) == 3 else weight)

    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = LLM(str(path), page_size=4, device="cpu", cpu_matmul="blas")
    try:
        expected = plain.generate(["Once upon a time"], params)[0].token_ids
    finally:
        plain.close()
    monkeypatch.setattr(onednn_weights, "onednn_reorder", wrong_once)
    with caplog.at_level(logging.WARNING, logger="aioserve.cpu_engine.fast_paths"):
        llm = LLM(str(path), page_size=4, device="cpu", cpu_matmul="onednn")
    try:
        assert len(calls) == 3 and "is off by" in caplog.text
        for module in _linears(llm):
            assert "weight" in module._parameters and not module.weight.is_mkldnn
            assert module.matmul_choice is not None and module.matmul_choice.onednn_weight is None
        assert llm.generate(["Once upon a time"], params)[0].token_ids == expected
    finally:
        llm.close()


def test_timed_beside_blas_the_layout_is_kept_where_it_wins(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The dispatch AMX's half math gets ("timed"), here in float32: the
    tuner times oneDNN's layout beside the BLAS forms per weight shape; made
    to win for the LM head's shape only, the head multiplies a reordered
    weight, the projections keep their BLAS forms and plain weights, and
    greedy equals transformers."""
    import dataclasses

    import aioserve.cpu.matmul as matmul
    import aioserve.engine.loading as loading

    monkeypatch.setenv("AIOSERVE_MATMUL_CACHE", str(tmp_path / "choices.json"))
    real_dispatch, real_seconds = loading.choose_cpu_dispatch, matmul._seconds
    monkeypatch.setattr(loading, "choose_cpu_dispatch", lambda *a, **k: dataclasses.replace(
        real_dispatch(*a, **{**k, "matmul": "blas"}), onednn="timed"))
    path = tiny_checkpoints["llama"]
    vocab = 0

    def seconds(fn, x, weight, to_beat):  # type: ignore[no-untyped-def]
        if fn is matmul.onednn_packed_linear:
            return 1e-9 if weight.shape[0] == vocab else float("inf")
        return real_seconds(fn, x, weight, to_beat)

    import json

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(matmul, "_seconds", seconds)
    llm = LLM(str(path), page_size=4, device="cpu")
    try:
        head = llm.engine.model.lm_head
        assert head.matmul_choice is not None and head.matmul_choice.onednn_weight is not None
        assert head.weight.is_mkldnn
        for module in _linears(llm):
            assert module.matmul_choice is not None and module.matmul_choice.onednn_weight is None
            assert not module.matmul_choice.onednn and "weight" in module._parameters
        check_against_hf(path, llm, [hf_encode(path, p) for p in PROMPTS[:2]])
    finally:
        llm.close()
    # Its reorder refused at the check: the head keeps the row-major BLAS forms the tuner chose beside it.
    real_reorder = onednn_weights.onednn_reorder
    monkeypatch.setattr(onednn_weights, "onednn_reorder", lambda weight: real_reorder(weight * 2))
    llm = LLM(str(path), page_size=4, device="cpu")
    try:
        head = llm.engine.model.lm_head
        assert head.matmul_choice is not None and not head.matmul_choice.onednn and head.matmul_choice.forms
        assert head.matmul_choice.onednn_weight is None and not head.weight.is_mkldnn
        check_against_hf(path, llm, [hf_encode(path, p) for p in PROMPTS[:2]])
    finally:
        llm.close()


def test_the_dispatch_reorders_for_float16_math_on_amx_only() -> None:
    """auto: AMX with float16 weights (no tile kernel of ours) times oneDNN's
    layout beside the BLAS forms; bfloat16 there takes the packed kernel on
    the tiles; float32, and every other family, keep the native packed
    kernel; the option forces each path on any family."""
    amx = PERSONALITIES["amx"]
    on_tiles = choose_cpu_dispatch(amx, torch.bfloat16)
    assert on_tiles.packed_matmul and on_tiles.native_decode and on_tiles.onednn == "off"
    assert "AMX tiles" in on_tiles.matmul_reason
    assert choose_cpu_dispatch(amx, torch.float16).onednn == "timed"
    assert choose_cpu_dispatch(amx, torch.float32).onednn == "off"
    for family in ("avx512_bf16", "avx512", "avx2"):
        for dtype in (torch.float32, torch.bfloat16):
            chosen = choose_cpu_dispatch(PERSONALITIES[family], dtype)
            assert chosen.packed_matmul and chosen.onednn == "off"
    for family, flags in PERSONALITIES.items():
        forced = choose_cpu_dispatch(flags, torch.float32, matmul="onednn")
        assert forced.onednn == "always" and not forced.packed_matmul and not forced.native_decode, family
        blas = choose_cpu_dispatch(flags, torch.bfloat16, matmul="blas")
        assert blas.onednn == "off" and not blas.packed_matmul and "--cpu-matmul blas" in blas.matmul_reason
        native = choose_cpu_dispatch(flags, torch.bfloat16, matmul="native")
        assert native.packed_matmul and native.onednn == "off"
    assert any("oneDNN prepacked" in line for line in choose_cpu_dispatch(amx, torch.float16).lines())
    assert MatmulChoice(False).onednn_weight is None
