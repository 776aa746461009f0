"""How the layers call FlashInfer's fused RMSNorm, RoPE and SiLU-and-mul on
CUDA (in place or not, the cos/sin cache's layout, which inputs qualify),
checked on CPU: the layers are routed to tests/fake_flashinfer.py's torch
rendering of those ops' documented semantics and must agree with their
torch forms. The real kernels run in tests/test_gpu_fast_path.py."""

from __future__ import annotations

import pytest
import torch

from aioserve.layers import flashinfer_elementwise, native_elementwise
from aioserve.layers.activation import silu_and_mul
from aioserve.layers.norm import RMSNorm
from aioserve.layers.rotary import RopeScaling, RotaryEmbedding
from fake_flashinfer import fake_flashinfer

DTYPE = torch.bfloat16


def _outputs(fused: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    monkeypatch.setattr(native_elementwise, "ENABLED", False)  # the CPU path would take these calls
    monkeypatch.setattr(flashinfer_elementwise, "DEVICE_TYPES", ("cuda", "cpu") if fused else ("cuda",))
    monkeypatch.setattr(flashinfer_elementwise, "_flashinfer", fake_flashinfer)
    monkeypatch.setattr(flashinfer_elementwise, "_tried", True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(DTYPE)
    residual = torch.randn(5, 64, generator=gen).to(DTYPE)
    norm = RMSNorm(64, 1e-6).to(DTYPE)
    norm.weight.data.copy_(torch.rand(64, generator=gen) + 0.5)
    normed = norm(x.clone())
    normed_sum, new_residual = norm(x.clone(), residual.clone())
    qkv = torch.randn(5, (4 + 2 + 2) * 32, generator=gen).to(DTYPE)  # q and k are strided views, as in llama.py
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    q, k = q.reshape(5, 4, 32), k.reshape(5, 2, 32)
    rotary = RotaryEmbedding(32, 128, 10000.0, RopeScaling("yarn", {"factor": 4.0, "original_max_position_embeddings": 32}))
    rotary.new_step()
    rq, rk = rotary(torch.tensor([0, 3, 17, 64, 127]), q, k)
    gate_up = torch.randn(5, 2 * 48, generator=gen).to(DTYPE)
    return [normed, normed_sum, new_residual, rq.clone(), rk.clone(), silu_and_mul(gate_up)]


def test_fused_ops_match_the_torch_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _outputs(False, monkeypatch)
    calls = []
    for name in ("rmsnorm", "fused_add_rmsnorm"):
        original = getattr(fake_flashinfer.norm, name)
        monkeypatch.setattr(fake_flashinfer.norm, name, lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
    fused = _outputs(True, monkeypatch)
    assert sorted(set(calls)) == ["fused_add_rmsnorm", "rmsnorm"]
    for ref, got in zip(reference, fused):
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.02)


def test_float32_and_strided_3d_rows_stay_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashinfer_elementwise, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(flashinfer_elementwise, "_flashinfer", fake_flashinfer)
    monkeypatch.setattr(flashinfer_elementwise, "_tried", True)
    assert flashinfer_elementwise.flashinfer_ops(torch.zeros(2, 2)) is None
    assert flashinfer_elementwise.flashinfer_ops(torch.zeros(2, 2, dtype=DTYPE)) is fake_flashinfer
    monkeypatch.setattr(flashinfer_elementwise, "ENABLED", False)
    assert flashinfer_elementwise.flashinfer_ops(torch.zeros(2, 2, dtype=DTYPE)) is None
