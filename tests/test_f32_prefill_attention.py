"""float32 prompt attention on AVX-512 FMAs (native/prefill_attention_f32.cpp):
equal to attention written out in float64 within float32's rounding, for
grouped KV heads, head dims 16 to 256 (48: two vectors and one), chunk
lengths that are not whole blocks, chunks after a cached prefix, sliding
windows, several requests at once and views of a projection; taken by the
torch_native backend for a float32 model's causal chunks, and through the
Python API the same tokens and prompt logprobs as torch's SDPA gives. Runs
where the kernels are built with AVX-512; the checks of its arguments run
everywhere the kernels build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.attention import torch_native
from aioserve.attention.torch_native import TorchNativeBackend
from aioserve.cpu.native import cpu_kernels
from aioserve.kvcache.kv_pool import KVPool
from hf_reference import hf_encode
from test_prefill_attention import extend_plan
from tiny_models import build_checkpoint


def _kernels():  # type: ignore[no-untyped-def]
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native kernels do not build here")
    if not kernels.prefill_f32_ready():
        pytest.skip("the kernels are built without AVX-512 here: SDPA serves float32 prompts")
    return kernels


def written_out(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, window: int | None,
                scale: float) -> torch.Tensor:
    """One request's chunk in float64: each query sees the keys up to itself,
    none `window` or more behind it."""
    length = q.shape[0]
    q_pos = torch.arange(length)[:, None] + prefix
    k_pos = torch.arange(prefix + length)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1).double(), values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


# (requests, query heads, KV heads, chunk length, cached prefix, head dim, sliding window)
SHAPES = [(1, 2, 1, 5, 0, 32, None), (1, 4, 2, 40, 0, 64, None), (2, 4, 2, 33, 7, 128, None),
          (3, 6, 3, 70, 30, 48, None), (1, 2, 2, 100, 200, 256, None), (2, 6, 6, 96, 0, 16, None),
          (1, 4, 2, 100, 0, 64, 17), (2, 4, 1, 45, 70, 48, 40), (1, 2, 2, 64, 0, 32, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_equals_attention_written_out(shape: tuple) -> None:
    kernels = _kernels()
    count, heads, kv_heads, length, prefix, dim, window = shape
    gen = torch.Generator().manual_seed(length + prefix)
    # q as a view of a q|k|v projection (its rows strided), as a layer has it.
    qkv = torch.randn(count * length, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].view(count * length, heads, dim)
    kv = torch.randn(count * (prefix + length), 2, kv_heads, dim, generator=gen)
    k, v = kv[:, 0], kv[:, 1]
    scale = dim**-0.5
    got = kernels.causal_prefill_attention(q, k, v, count, scale, None, window)
    assert got.dtype == torch.float32
    into = torch.full_like(got, float("nan"))
    kernels.causal_prefill_attention(q, k, v, count, scale, into, window)
    assert torch.equal(into, got)  # written in place, every element
    for r in range(count):
        rows, keys = slice(r * length, (r + 1) * length), slice(r * (prefix + length), (r + 1) * (prefix + length))
        expected = written_out(q[rows], k[keys], v[keys], prefix, window, scale)
        torch.testing.assert_close(got[rows].double(), expected, atol=1e-5, rtol=1e-5)


def test_the_arguments_are_checked() -> None:
    kernels = _kernels()
    q = torch.zeros(8, 2, 40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.causal_prefill_attention(q, q[:, :1], q[:, :1], 1, 0.1)
    q = torch.zeros(8, 3, 32)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernels.causal_prefill_attention(q, q[:, :2], q[:, :2], 1, 0.1)
    with pytest.raises(RuntimeError, match="kv_len >= q_len"):
        kernels.causal_prefill_attention(q, q[:4], q[:4], 1, 0.1)


@pytest.mark.parametrize("window", [None, 16])
def test_the_backend_takes_float32_causal_chunks(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """Fresh chunks side by side, a lone one, a long chunk after a cached
    prefix: the kernel takes each (with a window, a chunk at a time), and the
    result equals SDPA's within float32's rounding."""
    kernels = _kernels()
    calls: list[int] = []
    original = kernels.causal_prefill_attention
    monkeypatch.setattr(kernels, "causal_prefill_attention",
                        lambda *args: calls.append(args[3]) or original(*args))
    chunks = [(0, 40), (0, 40), (0, 17), (24, 64)]
    heads, kv_heads, dim = 6, 2, 48
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(1, 120, 4, kv_heads, dim, torch.float32, torch.device("cpu"))
    pool.buffer[:, :, 4:].normal_(generator=gen)
    tokens = sum(n for _, n in chunks)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    plan = extend_plan(chunks, first_page=1)
    results = {}
    for native in (True, False):
        monkeypatch.setattr(torch_native, "NATIVE_PREFILL", native)
        pool_copy = KVPool(1, 120, 4, kv_heads, dim, torch.float32, torch.device("cpu"))
        pool_copy.buffer.copy_(pool.buffer)
        results[native] = TorchNativeBackend(pool_copy).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    torch.testing.assert_close(results[True], results[False], atol=1e-5, rtol=1e-5)
    # The two 40s as one run (with a window, one by one), the 17, the chunk after the prefix.
    assert calls == ([1, 1, 1, 1] if window else [2, 1, 1])


def _run(model: Path, prompts: list[list[int]], native: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setattr(torch_native, "NATIVE_PREFILL", native)
    llm = LLM(str(model), dtype="float32", page_size=4, debug_integrity=True)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
        return llm.generate(prompts, params)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_through_the_python_api_prompts_follow_sdpa(tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 Llama (head dim 16) and Mistral (a 24-token window, head dim
    32): the same greedy tokens, and prompt logprobs within float32's
    rounding, with the kernel as with SDPA."""
    kernels = _kernels()
    overrides = {"head_dim": 32} if arch == "mistral" else {}
    model = build_checkpoint(arch, tmp_path / arch, overrides=overrides)
    calls: list[int] = []
    original = kernels.causal_prefill_attention
    monkeypatch.setattr(kernels, "causal_prefill_attention", lambda *args: calls.append(args[3]) or original(*args))
    # The second prompt outruns the window.
    texts = ["Once upon a time there was a little fox who", " ".join(str(i) for i in range(1, 31)), "the cat sat on"]
    prompts = [hf_encode(model, t) for t in texts]
    native = _run(model, prompts, True, monkeypatch)
    assert calls, "the kernel never served a prompt"
    taken = len(calls)
    plain = _run(model, prompts, False, monkeypatch)
    assert len(calls) == taken
    for a, b in zip(native, plain):
        assert a.token_ids == b.token_ids
        got = [entry[0] for entry in a.prompt_logprobs if entry is not None]
        want = [entry[0] for entry in b.prompt_logprobs if entry is not None]
        assert len(got) == len(want) and max(abs(x - y) for x, y in zip(got, want)) < 1e-4
