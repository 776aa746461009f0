"""The native elementwise kernels (native/elementwise.cpp) agree with their
torch twins, and greedy outputs are the same with and without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.engine.sampler import sample
from aioserve.kvcache.kv_pool import KVPool
from aioserve.cpu import elementwise as native_elementwise
from aioserve.layers.activation import silu_and_mul
from aioserve.layers.norm import RMSNorm
from aioserve.layers.rotary import RopeScaling, RotaryEmbedding
from aioserve.cpu.dispatch import choose_cpu_dispatch
from aioserve.cpu.isa import cpu_flags
from aioserve.cpu.native import cpu_kernels
from test_sampler import tensors
from tiny_models import build_checkpoint

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native kernels could not be built here")

HALF = [torch.bfloat16, torch.float16]
DTYPES = [torch.float32, *HALF]


@pytest.fixture
def twin(monkeypatch: pytest.MonkeyPatch):
    """Calls a function with the native elementwise kernels switched off."""

    def call(fn, *args):
        with monkeypatch.context() as patch:
            patch.setattr(native_elementwise, "ENABLED", False)
            return fn(*args)

    return call


def assert_matches(native: torch.Tensor, reference: torch.Tensor, rounded_to: torch.dtype | None = None) -> None:
    """float32 to float32 rounding; what was rounded to half precision on the
    way (`rounded_to`, by default the result's dtype) to one unit in its last
    place on a few elements (a float32 sum in another order can round a value
    to the neighbouring half-precision number)."""
    assert native.dtype == reference.dtype and native.shape == reference.shape
    if (rounded_to or native.dtype) == torch.float32:
        torch.testing.assert_close(native, reference, rtol=1e-6, atol=1e-6)
        return
    torch.testing.assert_close(native, reference, rtol=1e-2, atol=1e-2)
    assert (native == reference).float().mean() > 0.99


def head_views(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as the model has them: [T, H, D] views into one fused projection."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_float32", [False, True])
@pytest.mark.parametrize("shape", [(1, 288), (16, 288), (5, 67), (300, 64)])
def test_rms_norm(twin, dtype: torch.dtype, weight_float32: bool, shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    norm = RMSNorm(shape[1], 1e-6)
    norm.weight.data = (1 + torch.randn(shape[1], generator=generator) / 4).to(torch.float32 if weight_float32 else dtype)
    x = torch.randn(shape, generator=generator).to(dtype)
    residual = torch.randn(shape, generator=generator).to(dtype)
    assert_matches(norm(x), twin(norm, x), dtype)
    expected_out, expected_sum = twin(norm, x, residual)
    out, summed = norm(x, residual.clone())
    assert_matches(out, expected_out, dtype)
    assert torch.equal(summed, expected_sum)


def test_rms_norm_updates_the_residual_in_place() -> None:
    x, residual = torch.randn(3, 40), torch.randn(3, 40)
    expected = x + residual
    _, summed = RMSNorm(40, 1e-5)(x, residual)
    assert summed is residual and torch.equal(residual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_rms_norm_of_heads_inside_a_fused_projection(twin, dtype: torch.dtype, tokens: int) -> None:
    """Qwen3's per-head q/k norm: a strided [T, H, D] view, not a copy."""
    q, k, _ = head_views(tokens, 6, 2, 48, dtype, tokens)
    norm = RMSNorm(48, 1e-6).to(dtype)
    norm.weight.data.normal_(1, 0.2)
    for x in (q, k):
        assert tokens == 1 or not x.is_contiguous()
        assert_matches(norm(x), twin(norm, x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 16, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 6, 48), (8, 2, 32), (16, 8, 128), (4, 1, 6)])
@pytest.mark.parametrize("scaling", [RopeScaling(), RopeScaling("llama3", {
    "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0, "high_freq_factor": 4.0})])
def test_rotary_embedding(twin, dtype, tokens, heads, kv_heads, dim, scaling) -> None:
    rotary = RotaryEmbedding(dim, 512, 10000.0, scaling)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(tokens))
    q, k, _ = head_views(tokens, heads, kv_heads, dim, dtype, tokens * heads)
    expected_q, expected_k = twin(rotary, positions, q, k)
    out_q, out_k = rotary(positions, q, k)
    assert out_q is q and out_k is k  # rotated in place
    # The same ops with the same roundings, in the same order: equal bits.
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16,) * 2,
                                            (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("tokens", [1, 9])
def test_store_kv(twin, dtype: torch.dtype, kv_dtype: torch.dtype, tokens: int) -> None:
    native_pool = KVPool(2, 20, 4, 2, 48, kv_dtype, torch.device("cpu"))
    twin_pool = KVPool(2, 20, 4, 2, 48, kv_dtype, torch.device("cpu"))
    native_pool.buffer.zero_()
    twin_pool.buffer.zero_()
    _, k, v = head_views(tokens, 6, 2, 48, dtype, tokens)
    slots = torch.randperm(76, generator=torch.Generator().manual_seed(tokens))[:tokens] + 4
    native_pool.store(1, slots, k, v)
    twin(twin_pool.store, 1, slots, k, v)
    assert torch.equal(native_pool.buffer, twin_pool.buffer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 768), (16, 2 * 768), (3, 2 * 37), (2, 5, 2 * 64)])
def test_silu_and_mul(twin, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 4).to(dtype)
    assert_matches(silu_and_mul(x), twin(silu_and_mul, x))


def test_silu_and_mul_extremes(twin) -> None:
    gate = torch.tensor([-1e4, -100.0, -88.0, -20.0, 0.0, -0.0, 20.0, 89.0, 1e4, float("inf"), float("-inf"), float("nan")])
    x = torch.cat([gate, torch.full_like(gate, 1.5)])[None]
    torch.testing.assert_close(silu_and_mul(x), twin(silu_and_mul, x), equal_nan=True)


def reference_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.amax(dim=-1), logits.argmax(dim=-1)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("vocab", [7, 32000, 151936])
def test_row_max_argmax(rows: int, vocab: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    maxes, argmaxes = cpu_kernels().row_max_argmax(logits)
    expected_max, expected_arg = reference_max_argmax(logits)
    assert torch.equal(maxes, expected_max) and torch.equal(argmaxes, expected_arg)


@pytest.mark.parametrize("vocab", [32000, 151936])
def test_row_max_argmax_ties_nan_and_infinities(vocab: int) -> None:
    """The first index on ties (also across the chunks a row is split into),
    NaN as the max at its first position (torch.argmax's answer)."""
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[0, [vocab - 1, vocab // 2 + 1, vocab // 2]] = 50.0  # ties, across the middle
    logits[1, [vocab // 2 + 3, 5]] = float("nan")
    logits[2] = float("-inf")
    logits[3, [9, 3]] = float("inf")
    logits[4, 0] = float("nan")
    logits[5, -1] = 60.0
    logits[6] = 0.0
    logits[6, 100] = -0.0
    for rows in (logits, logits[1:2], logits[0:1]):
        maxes, argmaxes = cpu_kernels().row_max_argmax(rows)
        expected_max, expected_arg = reference_max_argmax(rows)
        assert torch.equal(argmaxes, expected_arg)
        torch.testing.assert_close(maxes, expected_max, equal_nan=True, rtol=0, atol=0)


def test_greedy_sample_matches_its_twin(twin) -> None:
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 17] = float("nan")
    logits[2] = float("-inf")
    logits[3, 3] = float("inf")
    st = tensors(5, temperature=0.0, wants_logprobs=False)
    native, reference = sample(logits, st), twin(sample, logits, st)
    assert native.token_ids.tolist() == reference.token_ids.tolist() == [logits[0].argmax().item(), 0, 0, 0,
                                                                         logits[4].argmax().item()]
    torch.testing.assert_close(native.logprobs, reference.logprobs, equal_nan=True)


@pytest.mark.parametrize("arch,options", [("llama3-rope", {}), ("qwen3", {}), ("llama", {"kv_cache_dtype": "bfloat16"}),
                                          ("qwen2", {"dtype": "bfloat16", "cpu_half_compute": "native"})])
def test_greedy_outputs_equal_with_and_without_the_kernels(tiny_checkpoints: dict[str, Path], arch: str, options: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time there was a little robot", "The quick brown fox", "a"]
    # Two engines: a second run on one would reuse the first one's cached prefixes.
    native_llm = LLM(str(tiny_checkpoints[arch]), page_size=4, device="cpu", **options)
    twin_llm = LLM(str(tiny_checkpoints[arch]), page_size=4, device="cpu", **options)
    assert native_llm.engine.attention.kernels is not None
    native = [o.token_ids for o in native_llm.generate(prompts, params)]
    monkeypatch.setattr(native_elementwise, "ENABLED", False)
    assert native == [o.token_ids for o in twin_llm.generate(prompts, params)]
    native_llm.close()
    twin_llm.close()


# -- q/k norms, RoPE and the KV write in one pass (qk_norm_rope_store) ---------------------


def separate_qk_ops(positions, q, k, v, rotary, q_weight, k_weight, pool, slots):
    """The three ops the one pass replaces, on copies: (q dense, k normed and rotated)."""
    kernels = cpu_kernels()
    if q_weight is not None:
        q, k = kernels.rms_norm(q, None, q_weight, 1e-6), kernels.rms_norm(k, None, k_weight, 1e-6)
    kernels.rotary_embedding(positions, q, k, rotary.cos_cache, rotary.sin_cache)
    kernels.store_kv(k, v, pool.keys(0), pool.values(0), slots)
    return q.contiguous(), k.contiguous()


def fuses_here(dtype: torch.dtype, dim: int) -> bool:
    return cpu_kernels().qk_norm_rope_store_fuses(torch.empty(1, 1, dim, dtype=dtype), torch.empty(1, 1, dim, dtype=dtype))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 16, 8, 128), (7, 16, 8, 128), (64, 6, 2, 64),
                                                       (5, 4, 1, 256), (300, 5, 5, 96), (3, 8, 8, 32)])
def test_qk_norm_rope_store_is_the_separate_ops_bit_for_bit(dtype, norm, tokens, heads, kv_heads, dim) -> None:
    """q normed and rotated (dense), k normed and rotated both in the cache
    and where it lies in q|k|v, v in the cache: the bits rms_norm,
    rotary_embedding and store_kv give one after the other (the same row
    functions), for any number of heads, GQA or not, with and without norms."""
    if not fuses_here(dtype, dim):
        pytest.skip("qk_norm_rope_store needs AVX-512 (the separate ops serve)")
    generator = torch.Generator().manual_seed(tokens * dim + heads)
    rotary = RotaryEmbedding(dim, 512, 10000.0, RopeScaling())
    positions = torch.randint(0, 512, (tokens,), generator=generator)
    slots = torch.randperm(60 * 4, generator=generator)[:tokens] + 4 if tokens <= 200 else torch.arange(tokens) + 4
    weights = [(1 + torch.randn(dim, generator=generator) / 4).to(dtype) for _ in range(2)] if norm else [None, None]
    q, k, v = head_views(tokens, heads, kv_heads, dim, dtype, tokens + heads)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    pools = [KVPool(1, 400 if tokens > 200 else 61, 4, kv_heads, dim, dtype, torch.device("cpu")) for _ in range(2)]
    for pool in pools:
        pool.buffer.zero_()
    expected_q, expected_k = separate_qk_ops(positions, q2, k2, v2, rotary, *weights, pools[1], slots)
    out = cpu_kernels().qk_norm_rope_store(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, *weights, 1e-6,
                                           pools[0].keys(0), pools[0].values(0), slots)
    assert out.is_contiguous() and out.shape == (tokens, heads, dim)
    assert torch.equal(out.view(torch.int16), expected_q.view(torch.int16))
    assert torch.equal(k.contiguous().view(torch.int16), expected_k.view(torch.int16))  # rotated in place
    assert torch.equal(pools[0].buffer.view(torch.int16), pools[1].buffer.view(torch.int16))


def test_qk_norm_rope_store_takes_only_what_it_is_exact_for() -> None:
    """float32 rows, an FP8 or wider cache, norm weights of another dtype
    than the rows' (a float32 weight promotes the normed head) or only
    one of them, a head dim that is not a multiple of 32 (or past 256), or
    the op turned off: the separate ops serve, and a call anyway is refused
    with the reason."""
    from aioserve.cpu.native_lib import library

    if not fuses_here(torch.bfloat16, 64):
        pytest.skip("qk_norm_rope_store needs AVX-512")
    kernels = cpu_kernels()
    bf16 = torch.empty(2, 4, 64, dtype=torch.bfloat16)
    assert kernels.qk_norm_rope_store_fuses(bf16, bf16) and fuses_here(torch.float16, 128)
    assert not kernels.qk_norm_rope_store_fuses(bf16.float(), bf16.float())
    assert not kernels.qk_norm_rope_store_fuses(bf16, bf16.float())
    assert not kernels.qk_norm_rope_store_fuses(bf16, bf16.to(torch.float8_e4m3fn))
    weight = torch.ones(64, dtype=torch.bfloat16)
    assert kernels.qk_norm_rope_store_fuses(bf16, bf16, weight, weight)
    assert not kernels.qk_norm_rope_store_fuses(bf16, bf16, weight.float(), weight.float())
    assert not kernels.qk_norm_rope_store_fuses(bf16, bf16, weight, weight.float())
    assert not kernels.qk_norm_rope_store_fuses(bf16, bf16, weight, None)
    assert not fuses_here(torch.bfloat16, 48) and not fuses_here(torch.bfloat16, 16) and not fuses_here(torch.bfloat16, 512)
    rotary = RotaryEmbedding(48, 64, 10000.0, RopeScaling())
    q, k, v = head_views(2, 2, 1, 48, torch.bfloat16, 0)
    cache = torch.zeros(8, 1, 48, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not for these rows, cache and norm weights"):
        kernels.qk_norm_rope_store(torch.arange(2), q, k, v, rotary.cos_cache, rotary.sin_cache, None, None, 0.0,
                                   cache, cache.clone(), torch.arange(2))
    q, k, v = head_views(2, 2, 1, 64, torch.bfloat16, 0)
    rotary = RotaryEmbedding(64, 64, 10000.0, RopeScaling())
    cache = torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    norm = torch.ones(64)
    with pytest.raises(RuntimeError, match="not for these rows, cache and norm weights"):
        kernels.qk_norm_rope_store(torch.arange(2), q, k, v, rotary.cos_cache, rotary.sin_cache, norm, norm, 1e-6,
                                   cache, cache.clone(), torch.arange(2))
    library().use_qk_norm_rope_store(False)
    try:
        assert not kernels.qk_norm_rope_store_fuses(bf16, bf16)
    finally:
        library().use_qk_norm_rope_store(True)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_greedy_outputs_equal_with_and_without_the_one_pass(tiny_checkpoints: dict[str, Path], arch: str,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the LLM in bf16, prompts through the modules and decodes
    through the native DecoderStack (Qwen3's per-head q/k norms; Gemma 3,
    whose windows and (1 + w) norms the DecoderStack leaves to the modules):
    the same tokens and logprobs with the one pass as with the separate ops
    (AIOSERVE_QK_ROPE_STORE=0), and the modules did take it."""
    from aioserve.cpu.native_lib import library

    if not fuses_here(torch.bfloat16, 32):
        pytest.skip("qk_norm_rope_store needs AVX-512")
    kernels = cpu_kernels()
    calls = []
    one_pass = kernels.qk_norm_rope_store
    monkeypatch.setattr(kernels, "qk_norm_rope_store", lambda *args: calls.append(1) or one_pass(*args))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["Once upon a time there was a little robot", "The quick brown fox", "a"]
    options = {"page_size": 4, "device": "cpu", "dtype": "bfloat16", "cpu_half_compute": "native"}
    model = build_checkpoint("gemma3", tmp_path / "gemma3") if arch == "gemma3" else tiny_checkpoints[arch]
    outputs = {}
    for on in (True, False):
        library().use_qk_norm_rope_store(on)
        llm = LLM(str(model), **options)  # one engine each: no prefix shared between the runs
        try:
            outputs[on] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
            decodes_native = getattr(llm.engine.graph_runner, "replays", 0)
        finally:
            llm.close()
            library().use_qk_norm_rope_store(True)
        assert bool(calls) == on  # the prompts' modules
        if arch == "qwen3" and choose_cpu_dispatch(cpu_flags(), torch.bfloat16, cpu_half_compute="native").native_decode:
            assert decodes_native > 0  # the decodes' DecoderStack (native/decoder.cpp) took its own call
        calls.clear()
    assert outputs[True] == outputs[False]
