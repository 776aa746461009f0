"""The greedy screen (native/greedy_screen.cpp, cpu_engine/greedy_screen.py)
gives the tokens the full float32 logits give, near-ties included, and
hands back the rows it cannot settle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.cpu_engine.greedy_screen import FLOAT16_MAX_ROWS, GreedyScreen, _bounds, dots_bf16_pairs, screen_copy
from aioserve.cpu.dispatch import choose_cpu_dispatch
from aioserve.cpu.isa import cpu_flags
from aioserve.cpu.native import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")

# The copies: float16 everywhere, bfloat16 where the kernels dot bf16 pairs (AVX512-BF16).
COPIES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    cpu_kernels() is None or not dots_bf16_pairs(cpu_kernels()), reason="no AVX512-BF16 dot products here"))]


def screen_of(weight: torch.Tensor, copy_dtype: torch.dtype, slack_scale: float = 1.0) -> GreedyScreen:
    kernels = cpu_kernels()
    if copy_dtype == torch.bfloat16 and weight.shape[1] % 2:
        pytest.skip("bf16 pairs need an even K")
    copy = screen_copy(weight, copy_dtype)
    slack, norms = _bounds(weight, copy)
    return GreedyScreen(
        kernels,
        kernels.pack_linear_weight(copy),
        kernels.pack_linear_weight(weight),
        slack * slack_scale,
        weight.shape[0],
        None if norms is None else norms * slack_scale,
    )


def full_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the sampler's greedy path picks from the packed LM head's logits."""
    kernels = cpu_kernels()
    logits = kernels.packed_linear(x, kernels.pack_linear_weight(weight), None, weight.shape[0], True)
    return kernels.row_max_argmax(logits)[1]


@pytest.mark.parametrize("copy_dtype", COPIES)
@pytest.mark.parametrize("n,k", [(1, 1), (33, 17), (1000, 64), (32000, 288)])
@pytest.mark.parametrize("rows", [1, 5, 8, 16])
def test_tokens_equal_the_full_logits_argmax(n: int, k: int, rows: int, copy_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(n + k + rows)
    weight = torch.randn(n, k, generator=generator) * 0.05
    x = torch.randn(rows, k, generator=generator) * 3
    screen = screen_of(weight, copy_dtype)
    # The kernel itself: GreedyScreen.argmax leaves batches past max_rows to the full logits.
    tokens, ok = cpu_kernels().screened_argmax(x, screen.screen, screen.slack, screen.exact, n, screen.screen_norms)
    assert ok.all()
    assert torch.equal(tokens, full_argmax(x, weight))


def near_tie(copy_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Columns a < b where the copy's rounding puts a ahead (by 8 d) and the
    float32 logits put b ahead (by 2 d), 8 d being the copy's step at 1
    (float16 2^-10, bfloat16 2^-7); the rest far below."""
    d = 2.0**-13 if copy_dtype == torch.float16 else 2.0**-10
    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(1)) * 0.01
    a, b = 3, 7
    weight[a] = 0.0
    weight[b] = 0.0
    weight[a, :2] = torch.tensor([1 + 5 * d, 1 - d])  # copy: 1 + 8d and 1, so 2 + 8d; exactly 2 + 4d
    weight[b, :2] = torch.tensor([1 + 3 * d, 1 + 3 * d])  # copy: 1 and 1, so 2; exactly 2 + 6d
    x = torch.zeros(1, 8)
    x[0, :2] = 1.0
    return weight, x, a, b


@pytest.mark.parametrize("copy_dtype", COPIES)
def test_a_near_tie_is_settled_by_the_float32_weights(copy_dtype: torch.dtype) -> None:
    weight, x, a, b = near_tie(copy_dtype)
    assert full_argmax(x, weight).tolist() == [b]
    assert screen_of(weight, copy_dtype).argmax(x).tolist() == [b]
    # Without the bound, the copy's logits alone would choose a: the case
    # really needs the exact recomputation.
    assert screen_of(weight, copy_dtype, slack_scale=0.0).argmax(x).tolist() == [a]


def test_the_bf16_screen_bounds_the_rounding_of_x_too() -> None:
    """x's own rounding to bf16 decides this near-tie. The weights are exact
    in bf16, x = (1 + 3 d, 1 - d) rounds to (1, 1) (d = 2^-10): the screen
    sees a = (0, 2 + 16 d) ahead of b = (4, -2) by 16 d, while the float32
    logits put b ahead, 2 + 14 d against 2 + 14 d - 16 d^2."""
    if not dots_bf16_pairs(cpu_kernels()):
        pytest.skip("no AVX512-BF16 dot products here")
    d = 2.0**-10
    weight = torch.zeros(10, 4)
    a, b = 2, 6
    weight[a, :2] = torch.tensor([0.0, 2 + 16 * d])
    weight[b, :2] = torch.tensor([4.0, -2.0])
    x = torch.zeros(1, 4)
    x[0, :2] = torch.tensor([1 + 3 * d, 1 - d])
    assert full_argmax(x, weight).tolist() == [b]
    assert screen_of(weight, torch.bfloat16).argmax(x).tolist() == [b]
    assert screen_of(weight, torch.bfloat16, slack_scale=0.0).argmax(x).tolist() == [a]


def test_tiny_weights_and_activations_flush_to_zero_safely() -> None:
    """Values below bf16's normal range are flushed in both copies (as the
    dot instruction would flush them); the bound still holds."""
    if not dots_bf16_pairs(cpu_kernels()):
        pytest.skip("no AVX512-BF16 dot products here")
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 40, generator=generator) * 0.05
    weight[:, ::3] *= 1e-38  # a third of every column subnormal or nearly
    x = torch.randn(4, 40, generator=generator)
    x[1, ::2] *= 1e-39
    x[2] *= 1e-36  # products far below float's normal range: the bound's absolute part
    x[3, :] = 0.0
    x[3, 7] = 1e-30
    screen = screen_of(weight, torch.bfloat16)
    for row in range(4):
        tokens = screen.argmax(x[row : row + 1])
        if tokens is not None:  # a row whose logits all sit within the underflow bound may be handed back
            assert torch.equal(tokens, full_argmax(x[row : row + 1], weight))
    assert torch.equal(screen.argmax(x[:2]), full_argmax(x[:2], weight))


@pytest.mark.parametrize("copy_dtype", COPIES)
def test_equal_logits_choose_the_first_column(copy_dtype: torch.dtype) -> None:
    weight = torch.randn(40, 16, generator=torch.Generator().manual_seed(2)) * 0.01
    weight[9] = weight[30] = torch.linspace(0.5, 1.0, 16)
    x = torch.ones(2, 16)
    assert screen_of(weight, copy_dtype).argmax(x).tolist() == full_argmax(x, weight).tolist() == [9, 9]


@pytest.mark.parametrize("copy_dtype", COPIES)
def test_rows_it_cannot_settle_go_back_to_the_full_logits(copy_dtype: torch.dtype) -> None:
    kernels = cpu_kernels()
    weight = torch.randn(300, 32, generator=torch.Generator().manual_seed(3)) * 0.02
    screen = screen_of(weight, copy_dtype)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    for bad in (float("nan"), float("inf")):
        broken = x.clone()
        broken[1, 5] = bad
        tokens, ok = kernels.screened_argmax(broken, screen.screen, screen.slack, screen.exact, 300, screen.screen_norms)
        assert ok.tolist() == [True, False, True] and tokens[1] == 0
        assert torch.equal(tokens[[0, 2]], full_argmax(x[[0, 2]], weight))
        assert screen.argmax(broken) is None
    # Many columns within the bound of the best: more than it recomputes.
    crowded = weight.clone()
    crowded[100:200] = 0.3
    assert screen_of(crowded, copy_dtype).argmax(torch.ones(1, 32)) is None


def test_no_screen_where_it_does_not_apply(tiny_checkpoints: dict[str, Path]) -> None:
    half = LLM(str(tiny_checkpoints["llama"]), page_size=4, device="cpu", dtype="bfloat16")
    # A bf16 head is half width already: no screen (its greedy rows may take the head's own argmax instead).
    assert not isinstance(half.engine.greedy_screen, GreedyScreen)
    half.close()
    kernels = cpu_kernels()
    head = torch.nn.Linear(8, 4, bias=False)
    head.weight.data = kernels.pack_linear_weight(torch.full((4, 8), 1e6))
    head.matmul_choice = type("Choice", (), {"packed_features": 4})()
    assert GreedyScreen.build(head, kernels, torch.float16) is None  # beyond float16's range
    # The copy the dispatch chooses for this CPU (bf16 where the kernels dot bf16 pairs) is one they can make.
    chosen = choose_cpu_dispatch(cpu_flags(), torch.float32).screen_dtype
    bf16 = dots_bf16_pairs(kernels)
    assert chosen == (torch.bfloat16 if bf16 else torch.float16)
    head.weight.data = kernels.pack_linear_weight(torch.full((4, 8), 3.4e38))
    assert GreedyScreen.build(head, kernels, chosen) is None  # beyond bf16's too
    head.weight.data = kernels.pack_linear_weight(torch.ones(4, 8))
    assert GreedyScreen.build(head, kernels, chosen) is not None
    assert GreedyScreen.build(head, kernels, None) is None  # no screen chosen (a sharded head, half math)
    assert (GreedyScreen.build(head, kernels, chosen).screen_norms is not None) == bf16
    float16 = GreedyScreen.build(head, kernels, torch.float16)
    assert float16.screen_norms is None
    # The float16 copy only pays while the head is bound by its bytes: past
    # FLOAT16_MAX_ROWS rows it steps aside.
    assert float16.argmax(torch.ones(FLOAT16_MAX_ROWS, 8)) is not None
    assert float16.argmax(torch.ones(FLOAT16_MAX_ROWS + 1, 8)) is None
    if not bf16:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            GreedyScreen.build(head, kernels, torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3's tiny checkpoint ties its embeddings
def test_generation_is_the_same_with_and_without_the_screen(tiny_checkpoints: dict[str, Path], arch: str) -> None:
    llm = LLM(str(tiny_checkpoints[arch]), page_size=4, device="cpu")
    screen = llm.engine.greedy_screen
    assert screen is not None
    calls = []
    screen_argmax = screen.argmax
    screen.argmax = lambda hidden: calls.append(hidden.shape[0]) or screen_argmax(hidden)  # type: ignore[method-assign]
    prompts = ["Once upon a time there was a little robot", "The quick brown fox", "a"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # A row with logprobs or a logit bias takes the sampler's path: the
    # screen must step aside for the whole step.
    mixed = [greedy, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logit_bias={5: 3.0})]
    screened = [o.token_ids for o in llm.generate(prompts, greedy)]
    screened_mixed = [o.token_ids for o in llm.generate(prompts, mixed)]
    assert calls and max(calls) == len(prompts)  # decode steps of all three went through it
    used = len(calls)
    llm.generate(prompts[1:2], mixed[1])
    assert len(calls) == used  # a logprobs request alone never uses it
    llm.engine.greedy_screen = None
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == screened
    assert [o.token_ids for o in llm.generate(prompts, mixed)] == screened_mixed
    llm.close()
