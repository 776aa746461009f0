"""The packed native matmul (native/gemm.cpp) agrees with torch's, packing
keeps tied embeddings and every layer computing the same values, and greedy
outputs are the same with the weights packed or left to BLAS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import aioserve.cpu_engine.fast_paths as fast_paths_module
import aioserve.engine.loading as loading_module
import aioserve.cpu.matmul as cpu_matmul_module
import aioserve.layers.embedding as embedding_module
from aioserve import LLM, SamplingParams
from aioserve.cpu.matmul import is_packed, pack_cpu_weights, packed_rows
from aioserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aioserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aioserve.cpu.native import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")

HALF = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
# k = 1024 and 2048: rows 4 KiB apart (float32, bf16 pairs), copied apart for the L1 (see gemm.cpp)
@pytest.mark.parametrize("n,k", [(1, 1), (33, 17), (64, 96), (300, 130), (40, 1024), (40, 2048)])
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 77])
def test_packed_linear_matches_torch(x_dtype, w_dtype, n, k, rows) -> None:
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight = torch.randn(n, k, generator=generator).to(w_dtype)
    bias = torch.randn(n, generator=generator)
    x = torch.randn(rows, k, generator=generator).to(x_dtype)
    packed = kernels.pack_linear_weight(weight)
    assert packed.dtype == w_dtype  # half weights stay half in memory
    # The reference: float32 math on the same (exactly widened) values.
    expected = F.linear(x.float(), weight.float(), bias)
    out = kernels.packed_linear(x, packed, bias, n)
    assert out.dtype == x_dtype and out.shape == (rows, n)
    tolerance = 1e-5 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance * max(1.0, k**0.5))
    torch.testing.assert_close(kernels.packed_linear(x, packed, None, n).float(), expected - bias,
                               rtol=tolerance, atol=tolerance * max(1.0, k**0.5))
    # float_out (the LM head): float32 holding exactly the x-dtype output's values.
    widened = kernels.packed_linear(x, packed, bias, n, float_out=True)
    assert widened.dtype == torch.float32 and torch.equal(widened, out.float())
    # out=: the same values, written where the caller says.
    into = torch.full((rows, n), float("nan"))
    assert kernels.packed_linear(x, packed, bias, n, True, into).data_ptr() == into.data_ptr()
    assert torch.equal(into, widened)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                             (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("n", [2048, 2050], ids=["rows 64-byte aligned", "rows not aligned"])
def test_large_outputs_are_the_rows_computed_alone(x_dtype, w_dtype, n) -> None:
    """Outputs past 2 MiB go to memory through non-temporal stores (gemm.cpp's
    RowsOut::stream) where their rows are 64-byte aligned: the same bits as
    the same rows computed in a call too small to stream, with and without
    bias, in x's dtype and as float_out; past a group of blocks and a last
    partial block (n = 2050), and with a last partial row tile (600 rows)."""
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(n)
    k, rows = 256, 600
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(w_dtype)
    bias = torch.randn(n, generator=generator)
    x = torch.randn(rows, k, generator=generator).to(x_dtype)
    packed = kernels.pack_linear_weight(weight)
    for b in (None, bias):
        for float_out in (False, True):
            whole = kernels.packed_linear(x, packed, b, n, float_out)
            assert whole.numel() * whole.element_size() > 2 << 20
            for first in (0, 288, 584):
                alone = kernels.packed_linear(x[first : first + 16], packed, b, n, float_out)
                assert torch.equal(whole[first : first + 16], alone)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("n,k", [(1, 1), (33, 17), (300, 130), (1000, 1024)])
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 37])
@pytest.mark.parametrize("tiles", [True, False], ids=["tiles if any", "no tiles"])
def test_packed_linear_argmax_is_row_max_argmax_of_the_logits(x_dtype, w_dtype, n, k, rows, tiles) -> None:
    """The fused greedy head: the (max, first argmax) row_max_argmax gives
    for packed_linear's float_out logits, bit for bit: ties (equal columns,
    an all-zero row, bf16 rounding), a bias, and a NaN column."""
    from aioserve.cpu.native_gemm import matrix_tiles_in_use, use_matrix_tiles

    kernels = cpu_kernels()
    before = matrix_tiles_in_use()
    use_matrix_tiles(tiles)
    try:
        generator = torch.Generator().manual_seed(n * 1000 + k + rows)
        weight = torch.randn(n, k, generator=generator)
        if n > 2:
            weight[n - 1] = weight[n // 2]  # the same logit twice: the first column wins
        x = torch.randn(rows, k, generator=generator).to(x_dtype)
        if rows:
            x[0] = 0  # every logit 0
        packed = kernels.pack_linear_weight(weight.to(w_dtype))
        for bias in (None, torch.randn(n, generator=generator)):
            logits = kernels.packed_linear(x, packed, bias, n, float_out=True)
            expected = kernels.row_max_argmax(logits)
            maxes, argmaxes = kernels.packed_linear_argmax(x, packed, bias, n)
            assert torch.equal(argmaxes, expected[1]) and torch.equal(maxes, expected[0])
        if n > 2 and rows:
            weight[n // 3, 0] = float("nan")  # one NaN logit a row: it is each row's answer
            packed = kernels.pack_linear_weight(weight.to(w_dtype))
            maxes, argmaxes = kernels.packed_linear_argmax(x, packed, None, n)
            assert argmaxes.tolist() == [n // 3] * rows and maxes.isnan().all()
    finally:
        use_matrix_tiles(before)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_rows_past_one_chunk_take_more_passes(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """x beyond gemm.cpp's chunk (1 MiB of rows) goes in several passes over W;
    every row still gets the result it gets alone."""
    kernels = cpu_kernels()
    k, n, rows = 2048, 70, 700  # 700 rows of 2048: 2.8-5.6 MiB of x
    weight, x = torch.randn(n, k).to(w_dtype), torch.randn(rows, k).to(x_dtype)
    packed = kernels.pack_linear_weight(weight)
    out = kernels.packed_linear(x, packed, None, n)
    tolerance = 1e-4 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=tolerance, atol=tolerance * k**0.5)
    for i in (0, 350, 699):
        assert torch.equal(kernels.packed_linear(x[i : i + 1], packed, None, n)[0], out[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 1), (33, 17), (300, 130), (70, 1024)])
def test_packing_is_the_documented_layout(dtype: torch.dtype, n: int, k: int) -> None:
    """[blocks, K, NB] zero-padded past N, or bf16 pairs [blocks, K / 2, NB, 2],
    from row-major and column-major weights alike."""
    kernels = cpu_kernels()
    block = kernels.gemm_block_width()
    weight = torch.randn(n, k).to(dtype)
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, k, dtype=dtype)
    padded[:n] = weight
    for stored in (weight, weight.t().contiguous().t()):
        packed = kernels.pack_linear_weight(stored)
        if packed.dim() == 4:
            assert dtype == torch.bfloat16 and k % 2 == 0
            expected = padded.view(blocks, block, k // 2, 2).transpose(1, 2)
        else:
            expected = padded.view(blocks, block, k).transpose(1, 2)
        assert packed.is_contiguous() and torch.equal(packed, expected)


@pytest.mark.parametrize("k,dtype", [(64, torch.float32), (1024, torch.float32), (2048, torch.bfloat16)])
def test_a_row_does_not_depend_on_its_batch(k: int, dtype: torch.dtype) -> None:
    kernels = cpu_kernels()
    weight, x = torch.randn(200, k).to(dtype), torch.randn(40, k).to(dtype)
    packed = kernels.pack_linear_weight(weight)
    together = kernels.packed_linear(x, packed, None, 200)
    for i in (0, 7, 39):
        assert torch.equal(kernels.packed_linear(x[i : i + 1], packed, None, 200)[0], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_empty_sum_gives_the_bias(dtype: torch.dtype) -> None:
    """K = 0: every output is the bias (its passes divide by a row's bytes:
    a zero there had stopped the process)."""
    kernels = cpu_kernels()
    packed = kernels.pack_linear_weight(torch.zeros(70, 0, dtype=dtype))
    bias = torch.arange(70.0).to(dtype)
    out = kernels.packed_linear(torch.zeros(13, 0, dtype=dtype), packed, bias, 70)
    assert torch.equal(out, bias.expand(13, 70))
    maxes, tokens = kernels.packed_linear_argmax(torch.zeros(13, 0, dtype=dtype), packed, None, 70)
    assert torch.equal(tokens, torch.zeros(13, dtype=torch.long)) and not maxes.any()


def test_bad_arguments_are_refused() -> None:
    kernels = cpu_kernels()
    packed = kernels.pack_linear_weight(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="features"):
        kernels.packed_linear(torch.randn(2, 9), packed, None, 40)
    with pytest.raises(RuntimeError, match="bad N"):
        kernels.packed_linear(torch.randn(2, 8), packed, None, 4000)
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        kernels.packed_linear(torch.randn(2, 8), torch.randn(40, 8), None, 40)
    for wrong in (torch.empty(2, 41), torch.empty(3, 40), torch.empty(40, 2).t(), torch.empty(2, 40, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="out must be"):
            kernels.packed_linear(torch.randn(2, 8), packed, None, 40, False, wrong)


def test_the_packed_lm_head_reuses_its_logits_buffer(monkeypatch) -> None:
    """The head's packed logits go into one buffer, reused while it is big
    enough and grown when not; each call's values are the fresh kernel's.
    Calls past MAX_BUFFERED_LOGITS get memory of their own."""
    torch.manual_seed(2)
    head = ParallelLMHead(300, 32)
    head.weight.data.normal_()
    assert pack_cpu_weights([head])
    kernels, n = cpu_kernels(), head.matmul_choice.packed_features
    first, second, third = torch.randn(4, 32), torch.randn(3, 32), torch.randn(9, 32)
    a = head(first)
    assert torch.equal(a, kernels.packed_linear(first, head.weight, None, n, True)[:, :300])
    b = head(second)  # smaller: the same memory
    assert b.data_ptr() == a.data_ptr()
    assert torch.equal(b, kernels.packed_linear(second, head.weight, None, n, True)[:, :300])
    c = head(third)  # bigger: grown
    assert torch.equal(c, kernels.packed_linear(third, head.weight, None, n, True)[:, :300])
    monkeypatch.setattr(embedding_module, "MAX_BUFFERED_LOGITS", 10 * n)
    big = head(torch.randn(11, 32))
    assert big.data_ptr() != head(third).data_ptr() and head._logits_buffer.numel() == 9 * n


def test_packing_keeps_every_layer_and_a_tied_embedding_equal() -> None:
    torch.manual_seed(1)
    embed = VocabParallelEmbedding(500, 64)
    embed.weight.data.normal_()
    head = ParallelLMHead(500, 64)
    head.tie_to(embed)
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True)
    up = MergedColumnParallelLinear(64, [96, 96])
    down = RowParallelLinear(192, 64)
    for module in (qkv, up, down):
        module.weight.data.normal_()
    qkv.bias.data.normal_()
    ids = torch.tensor([3, 499, 0, 42, 33])
    x, h = torch.randn(5, 64), torch.randn(5, 192)
    before = (embed(ids), head(x), qkv(x), up(x), down(h), up(x[None]))
    assert pack_cpu_weights([head, qkv, up, down])
    assert head.weight is embed.weight and is_packed(head.weight)  # still one tensor, packed once
    after = (embed(ids), head(x), qkv(x), up(x), down(h), up(x[None]))
    assert torch.equal(before[0], after[0])  # lookups read the packed rows exactly
    for a, b in zip(before[1:], after[1:]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_half_storage_packs_rounded_weights_exactly() -> None:
    layer = RowParallelLinear(48, 40)
    layer.weight.data.copy_(torch.randn(40, 48).to(torch.bfloat16))  # float32 holding bf16 values
    weight, x = layer.weight.data.clone(), torch.randn(3, 48)
    before = layer(x)
    assert pack_cpu_weights([layer], torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16  # half the bytes to read
    assert torch.equal(packed_rows(layer.weight, torch.arange(40)).float(), weight)
    torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-4)


def test_greedy_outputs_equal_packed_or_blas(tiny_checkpoints: dict[str, Path], monkeypatch) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time there was a little robot", "The quick brown fox", "a"]
    for arch in ("llama", "qwen3"):  # qwen3's tiny checkpoint ties its embeddings
        packed = LLM(str(tiny_checkpoints[arch]), page_size=4, device="cpu")
        assert is_packed(packed.engine.model.lm_head.weight)
        packed_out = [o.token_ids for o in packed.generate(prompts, params)]
        packed.close()
        with monkeypatch.context() as patch:
            patch.setattr(cpu_matmul_module, "cpu_kernels", lambda wait=True: None)
            blas = LLM(str(tiny_checkpoints[arch]), page_size=4, device="cpu")
        assert not is_packed(blas.engine.model.lm_head.weight)
        assert [o.token_ids for o in blas.generate(prompts, params)] == packed_out
        blas.close()


def test_a_start_before_the_kernels_are_built_packs_once_they_are(tiny_checkpoints: dict[str, Path], monkeypatch) -> None:
    """A first start serves with BLAS while the kernels build in the
    background, then packs its weights between two steps."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The quick brown fox"]
    building = lambda wait=True: None  # noqa: E731
    monkeypatch.setattr(cpu_matmul_module, "cpu_kernels", building)
    monkeypatch.setattr(loading_module, "cpu_kernels", building)
    monkeypatch.setattr(fast_paths_module, "cpu_kernels", building)
    llm = LLM(str(tiny_checkpoints["qwen3"]), page_size=4, device="cpu")
    head = llm.engine.model.lm_head
    blas = [o.token_ids for o in llm.generate(prompts, params)]
    assert not is_packed(head.weight)
    monkeypatch.setattr(cpu_matmul_module, "cpu_kernels", cpu_kernels)
    monkeypatch.setattr(loading_module, "cpu_kernels", cpu_kernels)  # the build is done
    monkeypatch.setattr(fast_paths_module, "cpu_kernels", cpu_kernels)
    assert [o.token_ids for o in llm.generate(prompts, params)] == blas
    assert is_packed(head.weight) and head.matmul_choice.packed_features is not None
    llm.close()


@pytest.mark.parametrize("columns", [(0, 200), (0, 96, 148, 200)], ids=["one part", "q|k|v"])
@pytest.mark.parametrize("dtype,held", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)],
                         ids=["float32", "bf16", "float32 x, bf16 adapters"])
def test_lora_add_rows_adds_each_rows_own_slot(dtype: torch.dtype, held: torch.dtype, columns: tuple[int, ...]) -> None:
    """native/lora.cpp: every row gets (x A_s^T) B_s of its own slot s
    (slot 0 nothing), whatever the mix: rows of one slot scattered among
    others, a slot covering all rows, all base; y of the rows' own type. A
    fused projection's B is block-diagonal, each part's block read in place
    and multiplied apart: the sum is the whole B's. A and B are held as
    they are; A's products are dot products over k in vector lanes: k = 100
    leaves a partial last lane group (float32: 6 + 4, bf16 pairs: 3 x 32 +
    4), and parts 96, 52 and 52 wide leave partial column groups (B held
    as its parts' blocks one after the other, `lora_part_blocks`). bf16
    weights under float32 math keep their adapters in bf16 (read as such)."""
    kernels = cpu_kernels()
    torch.manual_seed(0)
    parts, rank, k, n = len(columns) - 1, 8, 100, columns[-1]
    slots, band = 4, parts * rank
    a = torch.randn(slots, band, k) * 0.1
    b = torch.zeros(slots, band, n)
    for p, (start, end) in enumerate(zip(columns, columns[1:])):
        b[:, p * rank : (p + 1) * rank, start:end] = torch.randn(slots, rank, end - start) * 0.1
    a[0], b[0] = 0, 0
    held_a = [a[s].to(held).contiguous() for s in range(slots)]
    held_b = [kernels.lora_part_blocks(b[s], columns).to(held) for s in range(slots)]
    pointers = kernels.LoraPointers(held_a, held_b, band, k, n, columns)
    for row_slots in ([1, 0, 3, 1, 2, 0, 3, 3, 1], [2] * 5, [0, 0, 0], [3] * 40 + [0]):
        x = torch.randn(len(row_slots), k).to(dtype)
        y = torch.randn(len(row_slots), n).to(dtype)
        expected = y.float().clone()
        for row, slot in enumerate(row_slots):
            wa, wb = a[slot].to(held).float(), b[slot].to(held).float()
            h = (x[row].float() @ wa.T).to(dtype).float()  # the update's rank rows are rounded to the type too
            expected[row] += (h @ wb).to(dtype).float()
        kernels.lora_add_rows(x, y, torch.tensor(row_slots, dtype=torch.long), pointers)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), expected, atol=tolerance, rtol=tolerance)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.lora_add_rows(torch.zeros(1, k, dtype=dtype), torch.zeros(1, n, dtype=dtype),
                              torch.tensor([slots], dtype=torch.long), pointers)
    # A row's update never depends on the rows beside it (a decode step's
    # one row, a prefill chunk's 40): bit for bit.
    x = torch.randn(40, k).to(dtype)
    together = torch.zeros(40, n, dtype=dtype)
    kernels.lora_add_rows(x, together, torch.full((40,), 3, dtype=torch.long), pointers)
    for row in (0, 17, 39):
        alone = torch.zeros(1, n, dtype=dtype)
        kernels.lora_add_rows(x[row : row + 1], alone, torch.tensor([3]), pointers)
        assert torch.equal(alone[0], together[row])
    with pytest.raises(RuntimeError, match="do not fit together"):  # parts that do not share the band evenly
        kernels.LoraPointers(held_a, held_b, band, k, n, (0, 40, 80, 120, 160, n))  # 5 parts: 8 or 24 rows
    with pytest.raises(RuntimeError, match="must be \\[band, in\\]"):  # an A packed as a weight is refused
        kernels.LoraPointers([kernels.pack_linear_weight(w) for w in held_a], held_b, band, k, n, columns)
    with pytest.raises(RuntimeError, match="parts' blocks"):  # so is a B given whole, not as its parts' blocks
        kernels.LoraPointers(held_a, [b[s].to(held).contiguous() for s in range(slots)], band, k, n, columns)


@pytest.mark.parametrize("dtype,options", [("bfloat16", {}), ("bfloat16", {"cpu_half_compute": "float32"}),
                                           ("float16", {})], ids=["bf16", "bf16 weights float32 math", "fp16"])
def test_greedy_rows_take_a_half_heads_argmax_with_the_same_tokens(tiny_checkpoints: dict[str, Path], dtype,
                                                                   options) -> None:
    """A half model's greedy steps take their tokens from the packed LM head
    as it computes (HeadArgmax), and they are the tokens the full logits
    give: the same run with it off. Rows asking for logprobs, or sampling,
    go through the logits."""
    from aioserve.cpu_engine.head_argmax import HeadArgmax

    prompts = ["Once upon a time there was a little robot", "The quick brown fox", "a", "1 2 3 4"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_checkpoints["qwen3"]), page_size=4, device="cpu", dtype=dtype, **options)
    try:
        dispatch = llm.engine.cpu_dispatch
        if not dispatch.head_argmax:  # e.g. float16 on AMX: oneDNN's layout, not the packed head
            pytest.skip(f"this CPU takes no packed half head for {dtype}: {dispatch.matmul_reason}")
        head = llm.engine.greedy_screen
        assert isinstance(head, HeadArgmax)
        calls = []
        original = head.argmax
        head.argmax = lambda hidden: calls.append(hidden.shape[0]) or original(hidden)  # type: ignore[method-assign]
        fused = [o.token_ids for o in llm.generate(prompts, greedy)]
        assert calls and max(calls) == len(prompts)  # every step's rows, decodes and prompts' last tokens
        calls.clear()
        with_logprobs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1))
        assert not calls and [o.token_ids for o in with_logprobs] == fused
        llm.engine.greedy_screen = None
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == fused
    finally:
        llm.close()
