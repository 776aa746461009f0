"""How the layers call FlashInfer's fused RMSNorm, RoPE and SiLU-and-mul on
CUDA (in place or not, the cos/sin cache's layout, which inputs qualify),
checked on CPU: the layers are routed to tests/fake_flashinfer.py, which
computes those ops' documented semantics and raises `KernelFault` wherever
the real kernels would fault (misaligned vector loads, strided input read
as dense, a head dim with no kernel). The real kernels run in
tests/test_gpu_fast_path.py.

What is proven here: the fused forms agree with the torch forms; each
contract in aioserve/flashinfer/contracts.py refuses what the kernel model
faults on and never admits an input it faults on; the demo model (head_dim
8, intermediate 172: the shapes that crashed an H100) and tiny shapes run
through the fake without a fault, each op falling back for the reason that
is logged; and Llama/Qwen shapes with head_dim 64/128 take every fused op."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.cpu import elementwise as native_elementwise
from aioserve.flashinfer import contracts
from aioserve.flashinfer import elementwise as flashinfer_elementwise
from aioserve.flashinfer import gate_up_silu
from aioserve.flashinfer import loader as flashinfer_loader
from aioserve.layers.activation import gelu_tanh_and_mul, silu_and_mul
from aioserve.layers.norm import RMSNorm
from aioserve.layers.rotary import RopeScaling, RotaryEmbedding
from fake_flashinfer import KernelFault, fake_flashinfer
from tiny_models import build_checkpoint

DTYPE = torch.bfloat16


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """The layers' FlashInfer path taken on CPU tensors, through the fake."""
    monkeypatch.setattr(native_elementwise, "ENABLED", False)  # the CPU path would take these calls
    monkeypatch.setattr(flashinfer_elementwise, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(flashinfer_loader.FLASHINFER, "module", fake_flashinfer)
    monkeypatch.setattr(flashinfer_loader.FLASHINFER, "tried", True)
    # FlashInfer's ops alone: aioserve's gate|up + SiLU kernel (test_gate_up_silu.py) stays out.
    monkeypatch.setattr(gate_up_silu.KERNEL, "module", None)
    monkeypatch.setattr(gate_up_silu.KERNEL, "tried", True)
    flashinfer_elementwise.forget_decisions()
    yield
    flashinfer_elementwise.forget_decisions()


def _layer_outputs(head_dim: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(DTYPE)
    residual = torch.randn(5, 64, generator=gen).to(DTYPE)
    norm = RMSNorm(64, 1e-6).to(DTYPE)
    norm.weight.data.copy_(torch.rand(64, generator=gen) + 0.5)
    normed = norm(x.clone())
    normed_sum, new_residual = norm(x.clone(), residual.clone())
    qkv = torch.randn(5, (4 + 2 + 2) * head_dim, generator=gen).to(DTYPE)  # q and k are strided views, as in llama.py
    q, k, _ = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    q, k = q.reshape(5, 4, head_dim), k.reshape(5, 2, head_dim)
    head_norm = RMSNorm(head_dim, 1e-6).to(DTYPE)  # Qwen3's per-head norm over the strided view
    q_normed = head_norm(q)
    scaling = RopeScaling("yarn", {"factor": 4.0, "original_max_position_embeddings": 32})
    rotary = RotaryEmbedding(head_dim, 128, 10000.0, scaling)
    rotary.new_step()
    rq, rk = rotary(torch.tensor([0, 3, 17, 64, 127]), q, k)
    gate_up = torch.randn(5, 2 * 48, generator=gen).to(DTYPE)
    return [normed, normed_sum, new_residual, q_normed, rq.clone(), rk.clone(), silu_and_mul(gate_up),
            gelu_tanh_and_mul(gate_up)]


def test_fused_ops_match_the_torch_forms(monkeypatch: pytest.MonkeyPatch, fused_on_cpu: None) -> None:
    fused = _layer_outputs()
    assert all(op["fused"] and not op["fell_back"] for op in flashinfer_elementwise.report().values())
    monkeypatch.setattr(flashinfer_elementwise, "DEVICE_TYPES", ("cuda",))
    reference = _layer_outputs()
    for ref, got in zip(reference, fused):
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.02)


def test_the_in_place_head_norm_writes_over_k_in_the_projection(fused_on_cpu: None) -> None:
    """Qwen3's k-norm (in_place) writes through the strided view into the
    fused projection, so k stays beside v; the values are the copying norm's."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 128, generator=gen).to(DTYPE)
    k = qkv[:, 4 * 128 : 6 * 128].reshape(5, 2, 128)
    weight = torch.rand(128, generator=gen).to(DTYPE) + 0.5
    copying, in_place = RMSNorm(128, 1e-6).to(DTYPE), RMSNorm(128, 1e-6, in_place=True).to(DTYPE)
    for norm in (copying, in_place):
        norm.weight.data.copy_(weight)
    expected = copying(k)
    assert expected.data_ptr() != k.data_ptr()
    got = in_place(k)
    assert got.data_ptr() == k.data_ptr() and torch.equal(got, expected)
    assert torch.equal(qkv[:, 4 * 128 : 6 * 128].reshape(5, 2, 128), expected)


def test_float32_and_disabled_stay_in_torch(monkeypatch: pytest.MonkeyPatch, fused_on_cpu: None) -> None:
    weight = torch.ones(64, dtype=DTYPE)
    assert flashinfer_elementwise.RMSNORM.kernel(torch.zeros(2, 64), weight.float()) is None
    assert flashinfer_elementwise.RMSNORM.kernel(torch.zeros(2, 64, dtype=DTYPE), weight) is fake_flashinfer
    monkeypatch.setattr(flashinfer_elementwise, "ENABLED", False)
    assert flashinfer_elementwise.RMSNORM.kernel(torch.zeros(2, 64, dtype=DTYPE), weight) is None


# -- each contract against the kernel model ------------------------------------------------


def _offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """t's values at a data pointer `elements` past an aligned one."""
    buffer = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = buffer[elements:].view(t.shape)
    view.copy_(t)
    return view


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(DTYPE)


def _qkv_views(head_dim: int, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    qkv = _bf16(3, skip + 8 * head_dim)[:, skip:]
    q, k, _ = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    return q.reshape(3, 4, head_dim), k.reshape(3, 2, head_dim)


def _rope_call(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None):
    positions = torch.tensor([0, 1, 2]) if positions is None else positions
    cache = torch.randn(16, q.shape[-1])
    return (
        lambda: contracts.rope(q, k, positions, cache),
        lambda: fake_flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, q.shape[-1], cache),
    )


def _norm_call(x: torch.Tensor, residual: torch.Tensor | None = None):
    weight = torch.ones(x.shape[-1], dtype=x.dtype)
    if residual is None:
        return lambda: contracts.rmsnorm(x, weight), lambda: fake_flashinfer.norm.rmsnorm(x, weight)
    return (
        lambda: contracts.fused_add_rmsnorm(x, residual, weight),
        lambda: fake_flashinfer.norm.fused_add_rmsnorm(x, residual, weight),
    )


def _silu_call(x: torch.Tensor):
    return lambda: contracts.silu_and_mul(x), lambda: fake_flashinfer.activation.silu_and_mul(x)


def _gelu_call(x: torch.Tensor):
    return lambda: contracts.gelu_tanh_and_mul(x), lambda: fake_flashinfer.activation.gelu_tanh_and_mul(x)


VIOLATIONS = {
    "silu: the demo model's intermediate size 172": lambda: _silu_call(_bf16(3, 344)),
    "silu: a strided input": lambda: _silu_call(_bf16(3, 256)[:, :128]),
    "silu: a pointer 8 bytes off": lambda: _silu_call(_offset(_bf16(3, 128), 4)),
    "gelu: intermediate size 172": lambda: _gelu_call(_bf16(3, 344)),
    "gelu: a strided input": lambda: _gelu_call(_bf16(3, 256)[:, :128]),
    "rmsnorm: rows 136 bytes apart": lambda: _norm_call(_bf16(4, 68)[:, :64]),
    "rmsnorm: a pointer 2 bytes off": lambda: _norm_call(_offset(_bf16(4, 64), 1)),
    "rmsnorm: float32": lambda: _norm_call(torch.randn(4, 64)),
    "add-rmsnorm: a misaligned residual": lambda: _norm_call(_bf16(4, 64), _offset(_bf16(4, 64), 3)),
    "rope: head_dim 8": lambda: _rope_call(*_qkv_views(8)),
    "rope: head_dim 32": lambda: _rope_call(*_qkv_views(32)),
    "rope: q and k 8 bytes off": lambda: _rope_call(*_qkv_views(64, skip=4)),
    "rope: float positions": lambda: _rope_call(*_qkv_views(64), torch.tensor([0.0, 1.0, 2.0])),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_each_violation_is_refused_by_the_contract_and_faults_in_the_kernel_model(case: str) -> None:
    contract, kernel = VIOLATIONS[case]()
    assert contract() is not None
    with pytest.raises(KernelFault):
        kernel()


def test_the_contracts_never_admit_what_the_kernel_model_faults_on() -> None:
    """Random layouts (sizes, dtypes, pointer offsets, row padding, views):
    whatever a contract admits runs in the model without a fault."""
    gen = torch.Generator().manual_seed(1)
    admitted = 0

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for _ in range(300):
        dtype = pick([torch.float16, torch.bfloat16])
        width, pad, skip = pick([8, 36, 44, 64, 128, 172, 256]), pick([0, 1, 4, 8]), pick([0, 1, 2, 4, 8])
        rows = torch.randn(3, skip + 2 * width + pad).to(dtype)[:, skip : skip + 2 * width]
        calls = [_norm_call(rows[:, :width]), _norm_call(rows[:, :width], rows[:, width:].contiguous()),
                 _silu_call(rows), _silu_call(rows.contiguous()), _gelu_call(rows.contiguous())]
        if width in (8, 64, 128) and not pad:
            heads = rows.reshape(3, -1, width)
            calls.append(_rope_call(heads[:, : heads.shape[1] // 2], heads[:, heads.shape[1] // 2 :]))
        for contract, kernel in calls:
            if contract() is None:
                admitted += 1
                kernel()
    assert admitted > 100  # the sweep exercised the admitted side too


def test_paged_attention_contract_matches_the_wrapper_model() -> None:
    assert contracts.paged_attention(128, DTYPE, DTYPE) is None
    assert "head dims" in contracts.paged_attention(8, DTYPE, DTYPE)
    assert "float16/bfloat16" in contracts.paged_attention(64, torch.float32, DTYPE)
    wrapper = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(KernelFault, match="head_dim 8"):
        wrapper.plan(one, one[:1], one[1:], 4, 2, 8, 16)
    wide = torch.tensor([0, 1])
    assert contracts.paged_plan_arrays(wide, wide[:1], wide[1:]) is not None
    with pytest.raises(KernelFault, match="int32"):
        wrapper.plan(wide, wide[:1], wide[1:], 4, 2, 64, 16)


# -- whole models through the fake -----------------------------------------------------------


def _generate(model: Path, **options) -> list[list[int]]:
    llm = LLM(str(model), dtype="bfloat16", cpu_half_compute="native", cuda_graph=False, **options)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        return [o.token_ids for o in llm.generate([[1, 5, 9, 13, 17], [1, 2, 3]], params)]
    finally:
        llm.close()


def test_the_demo_model_falls_back_where_the_kernels_would_fault(
    stories_path: Path, fused_on_cpu: None, caplog: pytest.LogCaptureFixture
) -> None:
    """stories260K (head_dim 8, intermediate 172) crashed an H100 with
    "misaligned address": through the enforcing fake it must run, with RoPE
    and SiLU-and-mul in torch (logged once, with the reason) and the norms fused."""
    with caplog.at_level(logging.INFO, logger=flashinfer_elementwise.__name__):
        tokens = _generate(stories_path)
    assert [len(t) for t in tokens] == [8, 8]
    report = flashinfer_elementwise.report()
    assert report["rope"] == {"fused": False, "fell_back": ["head_dim 8 is not one its RoPE kernel is built for (64, 128, 256, 512)"]}
    assert not report["silu_and_mul"]["fused"] and "intermediate size 172" in report["silu_and_mul"]["fell_back"][0]
    assert report["rmsnorm"]["fused"] and report["fused_add_rmsnorm"]["fused"]
    logged = [r.getMessage() for r in caplog.records if "the torch form" in r.getMessage()]
    assert len(logged) == 2 and any("rope" in m for m in logged) and any("silu_and_mul" in m for m in logged)


# Tiny shapes that are not FlashInfer's: small head dims, hidden and
# intermediate sizes that are not multiples of 8 elements.
TINY_SHAPES = {
    "hd16-h36": dict(hidden_size=36, intermediate_size=44, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "hd32-h90": dict(hidden_size=90, intermediate_size=100, num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}
# Real models' shapes (Llama 3, Qwen2.5/3): head_dim 64/128, sizes multiples of 128.
REAL_SHAPES = {
    "llama-hd64": ("llama", dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "qwen3-hd128": ("qwen3", dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=128)),
}


@pytest.fixture(scope="module")
def shaped_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shaped")
    built = {name: build_checkpoint("llama", root / name, overrides=fields) for name, fields in TINY_SHAPES.items()}
    built.update({name: build_checkpoint(arch, root / name, overrides=fields) for name, (arch, fields) in REAL_SHAPES.items()})
    return built


@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
def test_tiny_shapes_run_through_the_kernel_model(shaped_checkpoints: dict[str, Path], name: str, fused_on_cpu: None) -> None:
    reference = _generate(shaped_checkpoints[name])
    assert [len(t) for t in reference] == [8, 8]
    report = flashinfer_elementwise.report()
    assert not report["rope"]["fused"] and report["rope"]["fell_back"]


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_real_shapes_take_every_fused_op(shaped_checkpoints: dict[str, Path], name: str, fused_on_cpu: None) -> None:
    _generate(shaped_checkpoints[name])
    report = flashinfer_elementwise.report()
    assert report == {op: {"fused": True, "fell_back": []} for op in report}, report
