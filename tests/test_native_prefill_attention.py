"""Native prompt attention: bf16 on AMX tiles (native/prefill_attention.cpp),
float32 on AVX-512 FMAs (native/prefill_attention_f32.cpp). Each equal to
attention written out within its dtype's rounding, for grouped KV heads,
head dims 32 to 256 (float32 from 16, and 48: two vectors and one), chunk
lengths that are not whole blocks, chunks after a cached prefix, sliding
windows, several requests at once and views of a projection; taken by the
torch_native backend for causal chunks (image rows that attend both ways
keep torch's SDPA), and through the Python API (bf16: Qwen3, Gemma 3's and
Mistral's windows; float32: Llama, Mistral) the same tokens and prompt
logprobs within rounding as SDPA gives. Each runs where its kernel does
(AMX tiles in use; AVX-512); the checks of the arguments run everywhere."""

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
from test_prefill_attention import extend_plan, reference
from tiny_models import build_checkpoint


def _kernels():  # type: ignore[no-untyped-def]
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native kernels do not build here")
    return kernels


def _tiles():  # type: ignore[no-untyped-def]
    kernels = _kernels()
    if not kernels.prefill_tiles_ready():
        pytest.skip("no AMX tiles here (or AIOSERVE_AMX=0): SDPA serves bf16 prompts")
    return kernels


def _native(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """The kernels, where the prompt kernel for `dtype` runs here."""
    if dtype == torch.bfloat16:
        return _tiles()
    kernels = _kernels()
    if not kernels.prefill_f32_ready():
        pytest.skip("the kernels are built without AVX-512 here: SDPA serves float32 prompts")
    return kernels


# How close the native kernels come to attention written out, and to SDPA: bf16's rounding, float32's.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}

# (requests, query heads, KV heads, chunk length, cached prefix, head dim, sliding window)
SHAPES = [(1, 2, 1, 5, 0, 32, None), (1, 4, 2, 40, 0, 64, None), (2, 4, 2, 33, 7, 128, None),
          (3, 6, 3, 70, 30, 64, None), (1, 2, 2, 100, 200, 256, None), (2, 16, 8, 96, 0, 128, None),
          (1, 4, 2, 100, 0, 64, 17), (2, 4, 1, 45, 70, 128, 40), (1, 2, 2, 64, 0, 256, 1)]
# Head dims only the float32 kernel takes (whole vectors, not whole tile rows).
F32_SHAPES = [(3, 6, 3, 70, 30, 48, None), (2, 6, 6, 96, 0, 16, None), (2, 4, 1, 45, 70, 48, 40)]
CASES = [(torch.bfloat16, s) for s in SHAPES] + [(torch.float32, s) for s in SHAPES + F32_SHAPES]


@pytest.mark.parametrize("dtype, shape", CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v).removeprefix("torch."))
def test_the_kernel_equals_attention_written_out(dtype: torch.dtype, shape: tuple) -> None:
    kernels = _native(dtype)
    count, heads, kv_heads, length, prefix, dim, window = shape
    gen = torch.Generator().manual_seed(length + prefix)
    # q as a view of a q|k|v projection (its rows strided), as a layer has it.
    qkv = torch.randn(count * length, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(count * length, heads, dim)
    kv = torch.randn(count * (prefix + length), 2, kv_heads, dim, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    scale = dim**-0.5
    got = kernels.causal_prefill_attention(q, k, v, count, scale, None, window)
    assert got.dtype == dtype
    into = torch.full_like(got, float("nan"))
    kernels.causal_prefill_attention(q, k, v, count, scale, into, window)
    assert torch.equal(into, got)  # written in place, every element
    tolerance = TOLERANCE[dtype]
    for r in range(count):
        rows, keys = slice(r * length, (r + 1) * length), slice(r * (prefix + length), (r + 1) * (prefix + length))
        expected = reference(q[rows], k[keys], v[keys], prefix, [], window, scale)
        torch.testing.assert_close(got[rows].float(), expected, atol=tolerance, rtol=tolerance)


def test_the_arguments_are_checked() -> None:
    kernels = _kernels()
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        kernels.causal_prefill_attention(q.half(), k.half(), k.half(), 1, 0.1)
    with pytest.raises(RuntimeError, match="all one dtype"):
        kernels.causal_prefill_attention(q, k.float(), k.float(), 1, 0.1)
    with pytest.raises(RuntimeError, match="last dim"):
        kernels.causal_prefill_attention(q.transpose(0, 2).contiguous().transpose(0, 2), k, k, 1, 0.1)
    with pytest.raises(RuntimeError, match="over 3 requests"):
        kernels.causal_prefill_attention(q, k, k, 3, 0.1)
    with pytest.raises(RuntimeError, match="q's shape and dtype"):
        kernels.causal_prefill_attention(q, k, k, 1, 0.1, torch.zeros(8, 2, 64))


def test_the_float32_kernels_arguments_are_checked() -> None:
    kernels = _native(torch.float32)
    q = torch.zeros(8, 2, 40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.causal_prefill_attention(q, q[:, :1], q[:, :1], 1, 0.1)
    q = torch.zeros(8, 3, 32)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernels.causal_prefill_attention(q, q[:, :2], q[:, :2], 1, 0.1)
    with pytest.raises(RuntimeError, match="kv_len >= q_len"):
        kernels.causal_prefill_attention(q, q[:4], q[:4], 1, 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("window", [None, 16])
def test_the_backend_takes_causal_chunks(monkeypatch: pytest.MonkeyPatch, window: int | None,
                                         dtype: torch.dtype) -> None:
    """Fresh chunks side by side, a lone one, a long chunk after a cached
    prefix: the native kernel takes each (with a window, a chunk at a time),
    and the result equals SDPA's within rounding."""
    kernels = _native(dtype)
    calls: list[int] = []
    original = kernels.causal_prefill_attention
    monkeypatch.setattr(kernels, "causal_prefill_attention",
                        lambda *args: calls.append(args[3]) or original(*args))
    chunks = [(0, 40), (0, 40), (0, 17), (24, 64)]
    heads, kv_heads, dim = 8, 2, 64
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(1, 120, 4, kv_heads, dim, dtype, torch.device("cpu"))
    pool.buffer[:, :, 4:].normal_(generator=gen)
    tokens = sum(n for _, n in chunks)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    plan = extend_plan(chunks, first_page=1)
    results = {}
    for native in (True, False):
        monkeypatch.setattr(torch_native, "NATIVE_PREFILL", native)
        pool_copy = KVPool(1, 120, 4, kv_heads, dim, dtype, torch.device("cpu"))
        pool_copy.buffer.copy_(pool.buffer)
        results[native] = TorchNativeBackend(pool_copy).prepare(plan, plan).attend(0, q, k, v, dim**-0.5, window)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(results[True].float(), results[False].float(), atol=tolerance, rtol=tolerance)
    # The two 40s as one run (with a window, one by one), the 17, the chunk after the prefix.
    assert calls == ([1, 1, 1, 1] if window else [2, 1, 1])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3 at head dim 64; Gemma 3 (a 12-token window on its local layers)
    and Mistral (a 24-token window) at 32; Llama at its 16."""
    root = tmp_path_factory.mktemp("tiled")
    return {"qwen3": build_checkpoint("qwen3", root / "qwen3", overrides={"head_dim": 64}),
            "gemma3": build_checkpoint("gemma3", root / "gemma3"),
            "mistral": build_checkpoint("mistral", root / "mistral", overrides={"head_dim": 32}),
            "llama": build_checkpoint("llama", root / "llama")}


def _run(model: Path, prompts: list[list[int]], dtype: torch.dtype, native: bool,
         monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setattr(torch_native, "NATIVE_PREFILL", native)
    llm = LLM(str(model), dtype=str(dtype).removeprefix("torch."), page_size=4, debug_integrity=True)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
        return llm.generate(prompts, params)
    finally:
        llm.close()


@pytest.mark.parametrize("arch, dtype", [("qwen3", torch.bfloat16), ("gemma3", torch.bfloat16),
                                         ("mistral", torch.bfloat16), ("llama", torch.float32),
                                         ("mistral", torch.float32)], ids=lambda v: str(v).removeprefix("torch."))
def test_through_the_python_api_prompts_follow_sdpa(models: dict[str, Path], arch: str, dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same prompts with the native kernel and with SDPA: bf16's prompt
    logprobs within its rounding and most first tokens alike; float32's
    tokens all alike and its logprobs within float32's rounding."""
    kernels = _native(dtype)
    calls: list[int] = []
    original = kernels.causal_prefill_attention
    monkeypatch.setattr(kernels, "causal_prefill_attention", lambda *args: calls.append(args[3]) or original(*args))
    model = models[arch]
    # The second prompt outruns both windows.
    texts = ["Once upon a time there was a little fox who", " ".join(str(i) for i in range(1, 31)), "the cat sat on"]
    prompts = [hf_encode(model, t) for t in texts]
    native = _run(model, prompts, dtype, True, monkeypatch)
    assert calls, "the native kernel never served a prompt"
    taken = len(calls)
    plain = _run(model, prompts, dtype, False, monkeypatch)
    assert len(calls) == taken
    within = 0.05 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(native, plain):
        got = [entry[0] for entry in a.prompt_logprobs if entry is not None]
        want = [entry[0] for entry in b.prompt_logprobs if entry is not None]
        assert len(got) == len(want) and max(abs(x - y) for x, y in zip(got, want)) < within
    if dtype == torch.float32:
        assert all(a.token_ids == b.token_ids for a, b in zip(native, plain))
    else:
        assert sum(a.token_ids[:4] == b.token_ids[:4] for a, b in zip(native, plain)) >= 2
