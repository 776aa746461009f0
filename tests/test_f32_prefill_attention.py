"""float32 prompt attention on AVX-512 FMAs (native/prefill_attention_f32.cpp):
equal to attention written out within float32's rounding, for grouped KV
heads, head dims 16 to 256 (48: two vectors and one), chunk lengths that
are not whole blocks, chunks after a cached prefix, sliding windows,
several requests at once and views of a projection; its arguments checked.
The backend and the Python API taking it: test_tiled_prefill_attention.py,
beside the bf16 kernel. Runs where the kernels are built with AVX-512."""

from __future__ import annotations

import pytest
import torch

from aioserve.cpu.native import cpu_kernels
from test_prefill_attention import reference


def _kernels():  # type: ignore[no-untyped-def]
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native kernels do not build here")
    if not kernels.prefill_f32_ready():
        pytest.skip("the kernels are built without AVX-512 here: SDPA serves float32 prompts")
    return kernels


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
        expected = reference(q[rows], k[keys], v[keys], prefix, [], window, scale)
        torch.testing.assert_close(got[rows], expected, atol=1e-5, rtol=1e-5)


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
