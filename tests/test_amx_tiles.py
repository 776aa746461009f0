"""The packed matmul's AMX tile path (native/gemm.cpp, `packed_linear_tiles`):
bf16 activations against pair-packed bf16 weights on the tile registers.

It runs only where the CPU has AMX (Sapphire Rapids and later) and the OS
lends the tiles; elsewhere these tests skip, saying so. There, every shape
the engine meets is checked against torch, the tiles against the pair dots
they replace, a row against its batch, and a model's greedy output on each
path against transformers'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aioserve.cpu.native import cpu_kernels

KERNELS = cpu_kernels()


def _tiles_available() -> bool:
    if KERNELS is None:
        return False
    from aioserve.cpu.native_gemm import use_matrix_tiles

    return use_matrix_tiles(True)


pytestmark = pytest.mark.skipif(not _tiles_available(), reason="this CPU has no AMX tiles (or the OS refuses them)")


@pytest.fixture
def tiles() -> Iterator[None]:
    """Tiles on for the test, the process's setting back after."""
    from aioserve.cpu.native_gemm import matrix_tiles_in_use, use_matrix_tiles

    before = matrix_tiles_in_use()
    assert use_matrix_tiles(True)
    yield
    use_matrix_tiles(before)


def _product(x: torch.Tensor, packed: torch.Tensor, n: int, tiles: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    from aioserve.cpu.native_gemm import use_matrix_tiles

    assert use_matrix_tiles(tiles) == tiles
    try:
        return KERNELS.packed_linear(x, packed, bias, n)
    finally:
        use_matrix_tiles(True)


# n: one partial block, whole blocks, a partial last block; k: the tile step
# (32), Qwen3-0.6B's widths, and 2048 (rows 4 KiB apart, spread in gemm.cpp).
@pytest.mark.parametrize("n,k", [(5, 32), (64, 96), (300, 1024), (70, 2048), (96, 3072)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 77])
def test_tiles_match_torch_and_the_pair_dots(tiles, n: int, k: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(n * 7 + k + rows)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    packed = KERNELS.pack_linear_weight(weight)
    assert packed.dim() == 4  # pair-packed: the layout the tiles read
    expected = F.linear(x.float(), weight.float(), bias)
    on_tiles = _product(x, packed, n, True, bias)
    on_dots = _product(x, packed, n, False, bias)
    assert on_tiles.dtype == torch.bfloat16 and on_tiles.shape == (rows, n)
    # bf16 output: one rounding of a float32 sum (the two paths add each
    # pair's two products in another order, so a last bit may differ).
    torch.testing.assert_close(on_tiles.float(), expected, rtol=2e-2, atol=2e-2 * k**0.5)
    torch.testing.assert_close(on_tiles.float(), on_dots.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(KERNELS.packed_linear(x, packed, bias, n, float_out=True), on_tiles.float())


def test_a_row_does_not_depend_on_its_batch_on_the_tiles(tiles) -> None:
    """Every row count takes the tiles (padded to 16 rows), so a request's
    result is the same alone, in a batch, or past one pass over W."""
    k, n = 2048, 200
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(700, k).bfloat16()  # 700 rows: 2.8 MiB, several passes
    packed = KERNELS.pack_linear_weight(weight)
    together = KERNELS.packed_linear(x, packed, None, n)
    for i in (0, 15, 16, 31, 350, 699):
        assert torch.equal(KERNELS.packed_linear(x[i : i + 1], packed, None, n)[0], together[i])
        assert torch.equal(KERNELS.packed_linear(x[i : i + 17], packed, None, n)[0], together[i])


def test_k_off_the_tile_step_keeps_the_pair_dots(tiles) -> None:
    """k not a multiple of 32 (a tile's 16 pairs): the pair dots serve, equal
    to what they give with the tiles turned off."""
    weight, x = torch.randn(40, 130).bfloat16(), torch.randn(9, 130).bfloat16()
    packed = KERNELS.pack_linear_weight(weight)
    assert torch.equal(_product(x, packed, 40, True), _product(x, packed, 40, False))


def test_aioserve_amx_0_turns_the_tiles_off() -> None:
    """AIOSERVE_AMX=0 at load: the pair dots (for a user who wants them, or
    to compare); the default takes the tiles."""
    code = ("from aioserve.cpu.native import cpu_kernels; cpu_kernels(); "
            "from aioserve.cpu.native_gemm import matrix_tiles_in_use; print(matrix_tiles_in_use())")
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "AIOSERVE_AMX": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("on_tiles", [True, False], ids=["tiles", "pair-dots"])
def test_bf16_greedy_follows_transformers_on_each_path(tiles, stories_path: Path, on_tiles: bool) -> None:
    """The engine's bf16 path with its weights packed (DecoderStack included)
    on the tiles and on the pair dots: transformers' bf16 argmax and
    logprobs, teacher-forced, within half-precision tolerance."""
    from aioserve import LLM, SamplingParams
    from aioserve.cpu.native_gemm import use_matrix_tiles
    from hf_reference import hf_encode
    from test_cpu_half import PROMPTS, assert_follows_transformers_bf16

    assert use_matrix_tiles(on_tiles) == on_tiles
    try:
        llm = LLM(str(stories_path), dtype="bfloat16", cpu_half_compute="native", cpu_matmul="native", device="cpu",
                  page_size=4)
        assert llm.engine.cpu_dispatch is not None and llm.engine.cpu_dispatch.packed_matmul
        prompts = [hf_encode(stories_path, p) for p in PROMPTS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0))
        llm.close()
    finally:
        use_matrix_tiles(True)
    assert_follows_transformers_bf16(stories_path, prompts, outs)
