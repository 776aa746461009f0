"""The CPU's paths are decided in one function of the flags and the options
(cpu/dispatch.py): its record for every x86 family is asserted here on any
machine, and an engine loaded as each family takes exactly the paths the
record names."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.cpu.dispatch import PERSONALITIES, CpuDispatch, choose_cpu_dispatch
from aioserve.cpu_engine.greedy_screen import GreedyScreen
from aioserve.cpu_engine.head_argmax import HeadArgmax
from aioserve.cpu.isa import cpu_flags
from aioserve.cpu.matmul import is_packed
from aioserve.cpu.native import cpu_kernels
from aioserve.cpu_engine.decode_stack import NativeDecodeRunner
import aioserve.engine.loading as loading_module

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (personality, weights, cpu_half_compute) -> (math, packed, native decode, screen copy)
TABLE = {
    ("amx", F32, "auto"): (F32, True, True, BF16),
    ("amx", BF16, "auto"): (BF16, True, True, None),  # the packed kernel, on the tiles (native/gemm.cpp)
    ("amx", F16, "auto"): (F16, False, False, None),  # oneDNN's fp16 on the tiles: no tile kernel of ours
    ("amx", BF16, "float32"): (F32, True, True, None),  # a bf16 head computed in float32: no screen to pay
    ("avx512_bf16", F32, "auto"): (F32, True, True, BF16),
    ("avx512_bf16", BF16, "auto"): (BF16, True, True, None),  # the packed kernel dots bf16 pairs
    ("avx512_bf16", F16, "auto"): (F32, True, True, None),  # no fp16 units: float32 math
    ("avx512", F32, "auto"): (F32, True, True, F16),
    ("avx512", BF16, "auto"): (F32, True, True, None),
    ("avx512", BF16, "native"): (BF16, True, True, None),
    ("avx2", F32, "auto"): (F32, True, True, F16),
    ("avx2", BF16, "auto"): (F32, True, True, None),
    ("avx2", F16, "native"): (F16, True, True, None),
}


@pytest.mark.parametrize("case", sorted(TABLE, key=str), ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}")
def test_the_decision_for_every_x86_family(case: tuple[str, torch.dtype, str]) -> None:
    personality, weights, half = case
    d = choose_cpu_dispatch(PERSONALITIES[personality], weights, cpu_half_compute=half)
    assert (d.math_dtype, d.packed_matmul, d.native_decode, d.screen_dtype) == TABLE[case]
    assert all(line.split(": ", 1)[1] for line in d.lines())  # every choice says why


@pytest.mark.parametrize("personality", sorted(PERSONALITIES))
def test_the_options_narrow_every_family_alike(personality: str) -> None:
    flags = PERSONALITIES[personality]
    off = choose_cpu_dispatch(flags, F32, native_kernels=False)
    assert (off.packed_matmul, off.native_decode, off.screen_dtype) == (False, False, None)
    assert "AIOSERVE_NATIVE=0" in off.matmul_reason and "packed" in off.decode_reason
    eager = choose_cpu_dispatch(flags, F32, decode_graphs=False)
    assert eager.packed_matmul and not eager.native_decode and "--disable-cuda-graph" in eager.decode_reason
    sharded = choose_cpu_dispatch(flags, F32, tp_size=2)
    assert not sharded.native_decode and sharded.screen_dtype is None and "tensor parallel" in sharded.decode_reason
    untuned = choose_cpu_dispatch(flags, BF16, matmul_tuning=False)
    assert not untuned.blas_tuning


def test_the_int8_head_screen_is_chosen_where_int8_products_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model's greedy head screens an int8 copy on AMX-INT8 (1-12
    rows) or AVX512-VNNI (1-4 rows; AMD Zen 4's flags), nowhere else, and
    never for float32 weights; AIOSERVE_INT8_HEAD_SCREEN=0 turns it off."""
    amx = choose_cpu_dispatch(PERSONALITIES["amx"], BF16)
    assert amx.int8_head_screen and "AMX-INT8" in amx.screen_reason
    zen4 = choose_cpu_dispatch(PERSONALITIES["avx512_bf16"] | {"avx512_vnni"}, BF16)
    assert zen4.int8_head_screen and "AVX512-VNNI" in zen4.screen_reason
    assert not choose_cpu_dispatch(PERSONALITIES["avx512_bf16"], BF16).int8_head_screen
    assert not choose_cpu_dispatch(PERSONALITIES["avx2"], BF16).int8_head_screen
    assert not choose_cpu_dispatch(PERSONALITIES["amx"], F32).int8_head_screen
    assert not choose_cpu_dispatch(PERSONALITIES["amx"], BF16, tp_size=2).int8_head_screen
    monkeypatch.setenv("AIOSERVE_INT8_HEAD_SCREEN", "0")
    assert not choose_cpu_dispatch(PERSONALITIES["amx"], BF16).int8_head_screen


def runnable_here(dispatch: CpuDispatch) -> str | None:
    """Why this machine cannot run what `dispatch` chose (a bf16 screen needs
    kernels built with AVX512-BF16), or None."""
    if dispatch.screen_dtype == BF16 and "avx512_bf16" not in cpu_flags():
        return "the bf16 greedy screen needs AVX512-BF16 on this machine"
    return None


@pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")
@pytest.mark.parametrize("personality", sorted(PERSONALITIES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_takes_the_paths_its_family_is_given(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    personality: str, dtype: str,
) -> None:
    """Loaded as each family would load it: the record is the one the table
    gives, logged, and the weights, decode runner and screen follow it; the
    tokens equal the modules' (--disable-cuda-graph) on the same paths."""
    expected = choose_cpu_dispatch(PERSONALITIES[personality], getattr(torch, dtype))
    if (why := runnable_here(expected)) is not None:
        pytest.skip(why)
    monkeypatch.setattr(loading_module, "cpu_flags", lambda: PERSONALITIES[personality])
    model = tiny_checkpoints["qwen3"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = []
    for graphs in (True, False):
        with caplog.at_level(logging.INFO, logger="aioserve.engine.loading"):
            llm = LLM(str(model), dtype=dtype, device="cpu", page_size=4, cuda_graph=graphs)
        try:
            engine = llm.engine
            assert engine.cpu_dispatch == choose_cpu_dispatch(
                PERSONALITIES[personality], getattr(torch, dtype), decode_graphs=graphs
            )
            if graphs:
                assert engine.dtype == expected.math_dtype
                assert is_packed(engine.model.model.layers[0].mlp.down_proj.weight) == expected.packed_matmul
                assert isinstance(engine.graph_runner, NativeDecodeRunner) == expected.native_decode
                assert isinstance(engine.greedy_screen, GreedyScreen) == (expected.screen_dtype is not None)
                assert isinstance(engine.greedy_screen, HeadArgmax) == expected.head_argmax
                if isinstance(engine.greedy_screen, HeadArgmax):
                    with_int8 = expected.int8_head_screen and cpu_kernels().int8_screen_ready()
                    assert (engine.greedy_screen.int8 is not None) == with_int8
                for line in expected.lines():
                    assert f"CPU path: {line}" in caplog.text
            outputs.append([o.token_ids for o in llm.generate(["Once upon a time", "1 2 3"], params)])
            if graphs and expected.native_decode:
                assert engine.graph_runner.replays > 0
        finally:
            llm.close()
    assert outputs[0] == outputs[1]
