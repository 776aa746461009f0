"""aioserve's fused q/k norm + RoPE + KV write (flashinfer/qk_rope_store.py):
its torch form equals the separate ops it replaces; its contract refuses
what the Triton kernel cannot read; on the CUDA code path (run on CPU: the
FlashInfer fake's attention and fused ops, the kernel's stand-in in
tests/fake_flashinfer.py) Qwen3, Llama and Gemma 3 layers take it, and the
prompt's logprobs and the greedy tokens follow the separate kernels' within
bfloat16's rounding; the Triton kernel's code equals the torch form under
Triton's CPU interpreter, and compiled, on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from aioserve.flashinfer import contracts
from aioserve.flashinfer import qk_rope_store as op
from aioserve.flashinfer.qk_rope_store import QK_ROPE_STORE, qk_rope_store_reference, self_check
from aioserve.kvcache.kv_pool import KVPool
from aioserve.layers.norm import RMSNorm
from aioserve.layers.rotary import RopeScaling, RotaryEmbedding
from own_kernel_runs import check_the_kernel_follows_the_separate_ones, head_dim_64_models


def _projection(tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q, k and v as views of one q|k|v projection, as a layer has them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return qkv, q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)


@pytest.mark.parametrize("norm", [True, False], ids=["qwen3-norms", "no-norms"])
def test_the_torch_form_equals_the_separate_ops(norm: bool) -> None:
    """Norm each head, rotate (RotaryEmbedding's torch form), store k and v
    (KVPool.store): the same q and pool, float32."""
    tokens, hq, hk, d = 6, 4, 2, 64
    _, q, k, v = _projection(tokens, hq, hk, d, torch.float32)
    rotary = RotaryEmbedding(d, 128, 10000.0, RopeScaling())
    positions = torch.tensor([0, 1, 5, 17, 64, 127])
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    if norm:
        q_norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        k_norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([3, 9, 4, 20, 31, 8])
    pools = [KVPool(1, 8, 4, hk, d, torch.float32, torch.device("cpu")) for _ in range(2)]

    qn, kn = (q_norm(q.clone()), k_norm(k.clone())) if norm else (q.clone(), k.clone())
    cos, sin = rotary.cos_cache[positions][:, None], rotary.sin_cache[positions][:, None]
    half = d // 2
    rot = lambda x: torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # noqa: E731
    separate_q, separate_k = qn * cos + rot(qn) * sin, kn * cos + rot(kn) * sin
    pools[0].store(0, slots, separate_k, v)

    weights = (q_norm.weight, k_norm.weight) if norm else (None, None)
    fused_q = qk_rope_store_reference(q, k, v, positions, rotary.cos_sin_halves(), *weights, 1e-6,
                                      pools[1].keys(0), pools[1].values(0), slots)
    torch.testing.assert_close(fused_q, separate_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1].buffer, pools[0].buffer, atol=1e-5, rtol=1e-5)
    assert fused_q.is_contiguous()


def test_the_contract_refuses_what_the_kernel_cannot_read() -> None:
    _, q, k, v = _projection(3, 4, 2, 64, torch.bfloat16)
    cache = torch.zeros(16, 2, 64, dtype=torch.bfloat16)
    positions, slots = torch.arange(3), torch.tensor([1, 2, 3])
    cos_sin = torch.zeros(8, 64)
    args = (q, k, v, positions, cos_sin, cache, cache, slots)
    assert contracts.qk_rope_store(*args) is None
    assert contracts.qk_rope_store(*args, torch.ones(64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)) is None
    fp8 = cache.to(torch.float8_e4m3fn)
    assert "k_cache" in contracts.qk_rope_store(q, k, v, positions, cos_sin, fp8, fp8, slots)
    _, q48, k48, v48 = _projection(3, 4, 2, 48, torch.bfloat16)
    assert "head_dim 48" in contracts.qk_rope_store(q48, k48, v48, positions, torch.zeros(8, 48), cache, cache, slots)
    _, q32, k32, v32 = _projection(3, 4, 2, 64, torch.float32)
    assert "float16/bfloat16" in contracts.qk_rope_store(q32, k32, v32, positions, cos_sin, cache, cache, slots)
    assert "int64" in contracts.qk_rope_store(*args[:7], slots.to(torch.int32))
    assert "norm weights" in contracts.qk_rope_store(*args, torch.ones(32, dtype=torch.bfloat16),
                                                     torch.ones(32, dtype=torch.bfloat16))
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads dense, dims strided
    assert "last dim" in contracts.qk_rope_store(strided, k, v, *args[3:])


def test_the_self_check_runs_the_kernel_against_the_torch_form() -> None:
    """The verdict a GPU gets before the kernel serves: None when it agrees,
    the reason when it does not or fails."""
    from types import SimpleNamespace

    from fake_flashinfer import fake_qk_rope_store

    cpu = torch.device("cpu")
    assert self_check(fake_qk_rope_store, torch.bfloat16, 128, True, cpu) is None

    def off_by_one(*args):  # type: ignore[no-untyped-def]
        return fake_qk_rope_store.qk_rope_store(*args) + 1

    assert "differed" in self_check(SimpleNamespace(qk_rope_store=off_by_one), torch.bfloat16, 64, False, cpu)

    def failing(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kernel image")

    assert "failed" in self_check(SimpleNamespace(qk_rope_store=failing), torch.bfloat16, 64, True, cpu)


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return head_dim_64_models(tmp_path_factory.mktemp("qk"))


@pytest.mark.parametrize("arch", ["qwen3", "llama3-rope"])
def test_layers_take_it_and_follow_the_separate_kernels(head_dim_64: dict[str, Path], arch: str) -> None:
    check_the_kernel_follows_the_separate_ones(head_dim_64[arch], op.KERNEL, QK_ROPE_STORE)


INTERPRETED = """
import sys
import torch
from aioserve.flashinfer import qk_rope_store_triton as kernel
from aioserve.flashinfer.qk_rope_store import qk_rope_store_reference
worst = 0.0
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for d, hq, hk in ((64, 4, 2), (128, 2, 2), (32, 3, 1)):
        for norm in (True, False):
            gen = torch.Generator().manual_seed(d + hq)
            qkv = torch.randn(7, (hq + 2 * hk) * d, generator=gen).to(dtype)
            q, k, v = (t.view(7, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
            angles = torch.rand(100, d // 2, generator=gen) * 6
            cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
            positions, slots = torch.tensor([0, 5, 9, 99, 3, 3, 50]), torch.tensor([1, 30, 2, 17, 8, 9, 0])
            weights = (torch.rand(d).to(dtype) + 0.5, torch.rand(d).to(dtype) + 0.5) if norm else (None, None)
            pools = [torch.zeros(32, hk, d, dtype=dtype) for _ in range(4)]
            got = kernel.qk_rope_store(q, k, v, positions, cos_sin, *weights, 1e-6, pools[0], pools[1], slots)
            want = qk_rope_store_reference(q, k, v, positions, cos_sin, *weights, 1e-6, pools[2], pools[3], slots)
            assert torch.equal(pools[1], pools[3]), "v"
            for a, b in ((got, want), (pools[0], pools[2])):
                worst = max(worst, (a.float() - b.float()).abs().max().item() / (1 if dtype == torch.float32 else 8))
print(worst)
sys.exit(0 if worst < 1e-2 else 1)
"""


def test_the_triton_kernel_interpreted_on_cpu_equals_the_torch_form() -> None:
    """The kernel's own code, run by Triton's interpreter (TRITON_INTERPRET=1,
    numpy on the CPU: its indexing, branches, norm and rotation, not its
    compilation) for three dtypes, head dims 32/64/128, GQA and views of a
    projection, against the torch form; in a child process, since the
    interpreter is chosen when triton is imported."""
    import os
    import subprocess

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("norm", [True, False])
def test_the_kernel_equals_the_torch_form_on_cuda(dtype: torch.dtype, head_dim: int, norm: bool) -> None:
    """The Triton kernel against its torch form on a GPU: q, the pool's k
    and v, for views of a projection, GQA, 40 tokens at scattered slots."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kernels = op.load_kernel()
    if kernels is None:
        pytest.skip(f"triton does not import: {op.KERNEL.import_error}")
    cuda = torch.device("cuda")
    assert self_check(kernels, dtype, head_dim, norm, cuda) is None
    tokens, hq, hk = 40, 8, 2
    _, q, k, v = (t.to(cuda) if i else t for i, t in enumerate(_projection(tokens, hq, hk, head_dim, dtype, seed=3)))
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, RopeScaling()).to(cuda)
    positions = torch.randperm(4096, device=cuda)[:tokens]
    slots = torch.randperm(512, device=cuda)[:tokens]
    weights = (torch.rand(head_dim, device=cuda).to(dtype) + 0.5, torch.rand(head_dim, device=cuda).to(dtype) + 0.5)
    weights = weights if norm else (None, None)
    caches = [torch.zeros(512, hk, head_dim, dtype=dtype, device=cuda) for _ in range(4)]
    got = kernels.qk_rope_store(q, k, v, positions, rotary.cos_sin_halves(), *weights, 1e-6, caches[0], caches[1], slots)
    expected = qk_rope_store_reference(q, k, v, positions, rotary.cos_sin_halves(), *weights, 1e-6, caches[2],
                                       caches[3], slots)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches[0], caches[2], atol=2e-2, rtol=2e-2)
    assert torch.equal(caches[1], caches[3])  # v is copied, not computed
