"""The int8 screen of a bf16 LM head (native/int8_head_screen.cpp,
cpu_engine/int8_head_screen.py) gives the tokens packed_linear_argmax gives,
exact ties and near-ties included, and hands back the rows it cannot settle.
It runs where the CPU has AMX-INT8 tiles (Sapphire Rapids and later) or
AVX512-VNNI (its form for 1-4 rows, also taken with the tiles turned off:
tested here wherever the library has it)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.cpu.native import cpu_kernels
from aioserve.cpu.native_lib import library

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.int8_screen_ready(),
                                reason="no AMX-INT8 tiles in use and no AVX512-VNNI here (or no native kernels)")
VNNI_BUILT = kernels is not None and bool(library().int8_head_screen_forms & 2)


@pytest.fixture(params=["as built", "vnni"])
def form(request: pytest.FixtureRequest):
    """The screen's form: as this CPU takes it (the tiles where the bf16
    products run on them), then VNNI's, with the tiles turned off."""
    if request.param == "as built":
        yield request.param
        return
    if not VNNI_BUILT:
        pytest.skip("no AVX512-VNNI here")
    had = library().tiles_in_use()
    library().use_tiles(False)
    try:
        yield request.param
    finally:
        library().use_tiles(had)


def head(n: int, k: int, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    torch.manual_seed(seed)
    return (torch.randn(n, k) * std).bfloat16()


def screened(x: torch.Tensor, weight: torch.Tensor, max_blocks: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    packed = kernels.pack_linear_weight(weight)
    copy = kernels.int8_quantize_head(packed, weight.shape[0])
    return kernels.int8_screened_argmax(x, copy, packed, weight.shape[0], max_blocks)


def heads_tokens(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return kernels.packed_linear_argmax(x, kernels.pack_linear_weight(weight), None, weight.shape[0])[1]


@pytest.mark.parametrize("n,k", [(328, 64), (1000, 128), (4101, 256), (32 * 40, 1024)])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 16])
def test_tokens_are_the_bf16_heads(n: int, k: int, rows: int, form: str) -> None:
    if rows > kernels.int8_screen_rows():
        pytest.skip(f"the {form} form takes {kernels.int8_screen_rows()} rows")
    weight = head(n, k, seed=n + rows)
    for scale in (0.05, 1.0, 30.0):
        x = (torch.randn(rows, k) * scale).bfloat16()
        tokens, ok = screened(x, weight)
        assert ok.all()
        assert torch.equal(tokens, heads_tokens(x, weight))


def test_exact_ties_go_to_the_first_column_and_near_ties_to_the_heads_choice(form: str) -> None:
    """Columns equal to each other tie exactly in bf16: the first wins, in
    whichever block it is. Columns a bf16 step apart in one weight: whatever
    the bf16 head says."""
    n, k = 700, 128
    weight = head(n, k, seed=3)
    x = torch.randn(4, k).bfloat16()
    winner = (x[0].float() / x[0].float().norm() * 0.5).bfloat16()
    for column in (650, 40, 333):
        weight[column] = winner
    tokens, ok = screened(x[:1], weight)
    assert ok.all() and tokens.item() == 40 == heads_tokens(x[:1], weight).item()
    near = weight.clone()
    bumped = near[650].view(torch.int16)
    bumped[:16] += 1  # one bf16 step further from zero, in 16 of its weights
    for rows in (x[:1], x):
        tokens, ok = screened(rows, near)
        assert ok.all() and torch.equal(tokens, heads_tokens(rows, near))


def test_the_token_in_a_partial_last_block_and_an_outlier_column(form: str) -> None:
    """The last block holds 5 columns (the rest packed as zeros, never a
    token); a column with one huge weight quantizes badly, and its bound
    still keeps it."""
    n, k = 32 * 7 + 5, 64
    weight = head(n, k, seed=5)
    x = torch.randn(2, k).bfloat16()
    weight[n - 2] = (x[1].float() / x[1].float().norm() * 0.3).bfloat16()
    weight[7] = 0.001
    weight[7, 0] = 50.0 * math.copysign(1.0, x[0, 0].item())
    tokens, ok = screened(x, weight)
    assert ok.all()
    assert torch.equal(tokens, heads_tokens(x, weight))
    assert tokens.tolist() == [7, n - 2]
    # Every logit negative, then every one positive: the bf16 floor on both sides of zero.
    negative = -torch.randn(1, k).abs().bfloat16()
    all_negative = -(weight.abs() + 0.01).bfloat16()
    for rows, w in ((-negative, all_negative), (negative, all_negative)):
        tokens, ok = screened(rows, w)
        assert ok.all() and torch.equal(tokens, heads_tokens(rows, w))


def test_rows_it_cannot_settle_are_left_to_the_caller(form: str) -> None:
    weight = head(500, 64, seed=7)
    x = torch.randn(3, 64).bfloat16()
    x[1, 5] = float("inf")
    tokens, ok = screened(x, weight)
    assert not ok.any()  # a row that is not finite: the whole step to the head
    zeros = torch.zeros(1, 64, dtype=torch.bfloat16)
    tokens, ok = screened(zeros, weight, max_blocks=8)
    assert not ok.any()  # every logit 0: all 16 blocks kept, past the limit
    tokens, ok = screened(zeros, weight, max_blocks=16)
    assert ok.all() and tokens.item() == 0 == heads_tokens(zeros, weight).item()  # within it: the first column
    tokens, ok = screened(torch.randn(2, 64).bfloat16(), weight, max_blocks=0)
    assert not ok.any()


def test_the_copy_is_a_scale_per_column_and_bounds_its_error() -> None:
    n, k = 300, 128
    weight = head(n, k, seed=9)
    weight[11] = 0  # a zero column: scale 1, nothing to bound
    weight[12, 3] = 1e-40  # a subnormal: read as zero by the tiles
    copy = kernels.int8_quantize_head(kernels.pack_linear_weight(weight), n)
    w = weight.double()
    w[w.abs() < 2.0**-126] = 0
    scales = torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 127, torch.ones(n, dtype=torch.float64)).float()
    assert torch.equal(copy.scales, scales)
    q = (w / scales.double()[:, None]).round()
    blocks = (n + 31) // 32
    unpacked = copy.screen.permute(0, 2, 1, 3).reshape(blocks * 32, k)
    assert torch.equal(unpacked[:n].double(), q) and not unpacked[n:].any()
    held = q * scales.double()[:, None]
    gamma = k * 2.0**-23 / (1 - k * 2.0**-23)
    assert (copy.slack.double() >= (w - held).norm(dim=1) + gamma * w.norm(dim=1)).all()
    assert (copy.norms.double() >= held.norm(dim=1)).all()
    assert copy.slack[11] == 0 or copy.slack[11] < 1e-30
    assert torch.equal(copy.column_sums[:n].long(), q.sum(dim=1).long()) and not copy.column_sums[n:].any()
    weight[20, 0] = float("nan")
    assert kernels.int8_quantize_head(kernels.pack_linear_weight(weight), n) is None


def test_bad_arguments_are_refused(form: str) -> None:
    import dataclasses

    weight = head(100, 64)
    packed = kernels.pack_linear_weight(weight)
    copy = kernels.int8_quantize_head(packed, 100)
    args = (copy, packed, 100, 8)
    limit = kernels.int8_screen_rows()
    with pytest.raises(RuntimeError, match=f"1 <= M <= {limit}"):
        kernels.int8_screened_argmax(torch.randn(limit + 1, 64).bfloat16(), *args)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.int8_screened_argmax(torch.randn(1, 64), *args)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernels.int8_quantize_head(kernels.pack_linear_weight(head(100, 96)), 100)
    with pytest.raises(RuntimeError, match="float32 \\[N\\]"):
        kernels.int8_screened_argmax(torch.randn(1, 64).bfloat16(), dataclasses.replace(copy, scales=copy.scales[:50]),
                                     packed, 100, 8)
    with pytest.raises(RuntimeError, match="int32 \\[blocks \\* 32\\]"):
        kernels.int8_screened_argmax(torch.randn(1, 64).bfloat16(),
                                     dataclasses.replace(copy, column_sums=copy.column_sums[:100]), packed, 100, 8)


def test_greedy_steps_of_a_few_rows_take_the_screens_tokens(tiny_checkpoints: dict[str, Path], form: str) -> None:
    """Through LLM.generate on a bf16 model: the screen answers the steps of
    1-12 greedy rows (1-4 on VNNI), steps of more go to the bf16 head, and the
    tokens are the ones the full logits give."""
    from aioserve.cpu_engine.head_argmax import HeadArgmax

    # No prefix cache: a prompt computed again after a cached prefix is other
    # bf16 sums, and the runs compared here repeat their prompts.
    llm = LLM(str(tiny_checkpoints["qwen3"]), page_size=4, device="cpu", dtype="bfloat16", cache="naive")
    try:
        head_argmax = llm.engine.greedy_screen
        assert isinstance(head_argmax, HeadArgmax) and head_argmax.int8 is not None
        assert llm.engine.cpu_dispatch.int8_head_screen
        answered: list[int] = []
        original = head_argmax.int8.argmax

        def counted(hidden: torch.Tensor) -> torch.Tensor | None:
            tokens = original(hidden)
            answered.append(hidden.shape[0] if tokens is not None else -hidden.shape[0])
            return tokens

        head_argmax.int8.argmax = counted  # type: ignore[method-assign]
        greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        few = ["Once upon a time there was a little robot", "The quick brown fox", "a"]
        many = [f"{i} little pigs went to {i + 1} markets" for i in range(14)]
        screened_tokens = [[o.token_ids for o in llm.generate(prompts, greedy)] for prompts in (few, many)]
        assert any(rows > 0 for rows in answered)  # the screen settled steps
        assert -14 in answered and max(answered) <= 12  # steps of 14 rows went to the bf16 head
        llm.engine.greedy_screen = None
        assert [[o.token_ids for o in llm.generate(prompts, greedy)] for prompts in (few, many)] == screened_tokens
    finally:
        llm.close()


def test_a_step_it_gives_back_rests_it_for_a_while() -> None:
    """After a step the screen cannot settle, the next steps go straight to
    the bf16 head (1, then 2, 4, ... in a row), and one it settles resets it."""
    from aioserve.cpu_engine.int8_head_screen import Int8HeadScreen

    weight = head(500, 64, seed=11)
    packed = kernels.pack_linear_weight(weight)
    screen = Int8HeadScreen.build(packed, 500, kernels)
    assert screen is not None
    good = torch.randn(2, 64).bfloat16()
    bad = good.clone()
    bad[0, 0] = float("nan")
    assert torch.equal(screen.argmax(good), heads_tokens(good, weight))
    answers = [screen.argmax(bad) for _ in range(4)]  # miss, rest 1, miss, rest 2 (of which one here)
    assert answers == [None] * 4 and (screen.rest, screen.backoff) == (1, 4)
    assert screen.argmax(good) is None and screen.rest == 0  # resting: not asked
    assert torch.equal(screen.argmax(good), heads_tokens(good, weight)) and screen.backoff == 1
