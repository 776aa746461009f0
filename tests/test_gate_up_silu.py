"""aioserve's gate|up projection + SiLU-and-mul kernel
(flashinfer/gate_up_silu.py): its torch form equals the projection and the
activation it replaces; its contract refuses what the Triton kernel cannot
read; its self-check refuses a kernel that is wrong, fails, or is slower
than the separate kernels, and picks the fastest column block; on the CUDA
code path (run on CPU through the stand-in in tests/fake_flashinfer.py) a
dense model's decode rows take it, prefill chunks and LoRA layers do not,
and the greedy tokens and logprobs follow the separate kernels within
bfloat16's rounding; the Triton kernel's code equals the torch form under
Triton's interpreter, and compiled, on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from aioserve.flashinfer import contracts
from aioserve.flashinfer import gate_up_silu as op
from aioserve.flashinfer.gate_up_silu import GATE_UP_SILU, gate_up_silu_reference, self_check
from fake_flashinfer import KernelFault, fake_gate_up_silu
from own_kernel_runs import check_the_kernel_follows_the_separate_ones, head_dim_64_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_census  # noqa: E402  (the CUDA code path on CPU)


def _inputs(rows: int, depth: int, width: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).to(dtype)
    weight = (torch.randn(2 * width, depth, generator=gen) / depth**0.5).to(dtype)
    return x, weight


def _separate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def test_the_torch_form_equals_the_projection_and_the_activation() -> None:
    x, weight = _inputs(5, 64, 48, torch.float32)
    torch.testing.assert_close(gate_up_silu_reference(x, weight), _separate(x, weight), atol=1e-5, rtol=1e-5)
    half_x, half_w = x.bfloat16(), weight.bfloat16()
    got = gate_up_silu_reference(half_x, half_w)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    torch.testing.assert_close(got.float(), _separate(half_x.float(), half_w.float()), atol=2e-2, rtol=2e-2)


def test_the_contract_refuses_what_the_kernel_cannot_read() -> None:
    x, weight = _inputs(4, 64, 32, torch.bfloat16)
    assert contracts.gate_up_silu(x, weight) is None
    assert "rows" in contracts.gate_up_silu(torch.zeros(17, 64, dtype=torch.bfloat16), weight)
    assert "float16/bfloat16" in contracts.gate_up_silu(x.float(), weight.float())
    assert "not torch.bfloat16" in contracts.gate_up_silu(x, weight.half())
    assert "[2N, K]" in contracts.gate_up_silu(x, weight[:, :32])
    assert "fewer than one block" in contracts.gate_up_silu(x, weight[:16])
    assert "contiguous" in contracts.gate_up_silu(x, weight.t().contiguous().t())
    assert "contiguous" in contracts.gate_up_silu(x.t().contiguous().t(), weight)
    # The stand-in refuses the same inputs on its own (a contract written too loosely fails here).
    with pytest.raises(KernelFault):
        fake_gate_up_silu.gate_up_silu(torch.zeros(17, 64, dtype=torch.bfloat16), weight, 32)
    with pytest.raises(KernelFault):
        fake_gate_up_silu.gate_up_silu(x, weight.t().contiguous().t(), 32)


def test_the_self_check_refuses_a_wrong_failing_or_slower_kernel() -> None:
    x, weight = _inputs(1, 64, 32, torch.bfloat16)
    separate = lambda rows: _separate(rows, weight)  # noqa: E731
    assert self_check(fake_gate_up_silu, weight, 1, separate, None) == (None, op.BLOCK_N_CHOICES[1])

    def off(x, w, block_n):  # type: ignore[no-untyped-def]
        return fake_gate_up_silu.gate_up_silu(x, w, block_n) + (0.5 if block_n == 64 else 0)

    why, _ = self_check(SimpleNamespace(gate_up_silu=off), weight, 1, separate, None)
    assert why is not None and "block of 64 columns differed" in why

    def failing(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kernel image")

    assert "failed" in self_check(SimpleNamespace(gate_up_silu=failing), weight, 1, separate, None)[0]

    # Timed: each block and the separate kernels once; the fastest block serves, if it beats them.
    def timer_of(kernel_us: dict[int, float], separate_us: float):  # type: ignore[no-untyped-def]
        def timer(call):  # type: ignore[no-untyped-def]
            calls.clear()
            call()
            return kernel_us[calls[0]] if calls else separate_us
        return timer

    calls: list[int] = []

    def recorded(x, w, block_n):  # type: ignore[no-untyped-def]
        calls.append(block_n)
        return fake_gate_up_silu.gate_up_silu(x, w, block_n)

    kernels = SimpleNamespace(gate_up_silu=recorded)
    assert self_check(kernels, weight, 1, separate, timer_of({16: 9.0, 32: 6.0, 64: 7.0}, 8.0)) == (None, 32)
    why, _ = self_check(kernels, weight, 1, separate, timer_of({16: 9.0, 32: 8.5, 64: 9.5}, 8.0))
    assert why is not None and "8.5 us against the separate kernels' 8.0 us" in why


def test_the_op_decides_once_per_row_bucket_and_never_while_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight = _inputs(3, 64, 32, torch.bfloat16)
    checks: list[int] = []

    def counted(kernels, w, rows, separate, timer):  # type: ignore[no-untyped-def]
        checks.append(rows)
        return None, 16

    monkeypatch.setattr(op, "self_check", counted)
    GATE_UP_SILU.forget()
    try:
        separate = lambda rows: _separate(rows, weight)  # noqa: E731
        for rows in (3, 4, 3, 1, 16, 9):
            got = GATE_UP_SILU.run(fake_gate_up_silu, x[:1].expand(rows, -1).contiguous(), weight, separate)
            assert got is not None and got.shape == (rows, 32)
        assert checks == [4, 1, 16]  # buckets 4 (3 and 4), 1, 16 (16 and 9)
        assert GATE_UP_SILU.fused() and GATE_UP_SILU.block_n[(torch.bfloat16, (64, 64), 4, "cpu")] == 16
        assert [op.row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    finally:
        GATE_UP_SILU.forget()


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return head_dim_64_models(tmp_path_factory.mktemp("mlp"))


@pytest.mark.parametrize("arch", ["qwen3", "llama3-rope"])
def test_decode_rows_take_it_and_follow_the_separate_kernels(dense_models: dict[str, Path], arch: str) -> None:
    check_the_kernel_follows_the_separate_ones(dense_models[arch], op.KERNEL, GATE_UP_SILU)


def test_layers_with_lora_or_many_rows_keep_the_separate_kernels() -> None:
    """A LoRA layer adds its update between the projection and the activation,
    and a prefill chunk has more rows than the kernel's tile: neither asks."""
    from aioserve.layers.activation import gate_up_and_silu
    from aioserve.layers.linear import MergedColumnParallelLinear

    proj = MergedColumnParallelLinear(64, [32, 32])
    proj.weight.data.copy_(_inputs(1, 64, 32, torch.float32)[1])
    proj = proj.to(torch.bfloat16)
    with kernel_census.cuda_code_path(kernel_census.KernelCounter()):
        x = _inputs(2, 64, 32, torch.bfloat16)[0]
        long = torch.randn(40, 64).bfloat16()
        torch.testing.assert_close(gate_up_and_silu(proj, long).float(), _separate(long, proj.weight).float(),
                                   atol=2e-2, rtol=2e-2)
        assert not GATE_UP_SILU.asked()
        proj.lora = SimpleNamespace(add_to=lambda rows, y: y + 1.0)  # type: ignore[assignment]
        with_lora = gate_up_and_silu(proj, x)
        assert not GATE_UP_SILU.asked()
        gate, up = (F.linear(x, proj.weight) + 1.0).chunk(2, dim=-1)
        torch.testing.assert_close(with_lora.float(), (F.silu(gate) * up).float(), atol=2e-2, rtol=2e-2)
        proj.lora = None
        plain = gate_up_and_silu(proj, x)
        assert GATE_UP_SILU.fused()
        torch.testing.assert_close(plain.float(), gate_up_silu_reference(x, proj.weight).float())


INTERPRETED = """
import sys
import torch
from aioserve.flashinfer import gate_up_silu_triton as kernel
from aioserve.flashinfer.gate_up_silu import gate_up_silu_reference
worst = 0.0
# bfloat16 is left to the GPU test: the interpreter's tl.dot misreads bfloat16 tiles.
for dtype in (torch.float32, torch.float16):
    for rows, depth, width in ((1, 256, 96), (5, 200, 64), (16, 128, 40), (3, 384, 130)):
        gen = torch.Generator().manual_seed(rows + depth)
        x = torch.randn(rows, depth, generator=gen).to(dtype)
        weight = (torch.randn(2 * width, depth, generator=gen) / depth**0.5).to(dtype)
        want = gate_up_silu_reference(x, weight).float()
        for block_n in (16, 32, 64):
            got = kernel.gate_up_silu(x, weight, block_n).float()
            worst = max(worst, (got - want).abs().max().item() / (1 if dtype == torch.float32 else 8))
print(worst)
sys.exit(0 if worst < 1e-3 else 1)
"""


def test_the_triton_kernel_interpreted_on_cpu_equals_the_torch_form() -> None:
    """The kernel's own code under Triton's interpreter (TRITON_INTERPRET=1:
    its masks, strides, K loop and epilogue, not its compilation), for rows
    1 to 16, widths not a multiple of the block, K not a multiple of 128; in
    a child process, since the interpreter is chosen when triton is imported."""
    import os
    import subprocess

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1024, 3072), (4096, 14336), (200, 130)], ids=["qwen3-0.6b", "llama-3-8b", "odd"])
def test_the_kernel_equals_the_torch_form_on_cuda(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """The Triton kernel against its torch form on a GPU, every column block,
    1 to 16 rows; then the self-check with the device timer decides (either
    way) and says why."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kernels = op.KERNEL.load()
    if kernels is None:
        pytest.skip(f"triton does not import: {op.KERNEL.import_error}")
    depth, width = shape
    weight = _inputs(1, depth, width, dtype, seed=5)[1].cuda()
    for rows in (1, 2, 5, 16):
        x = torch.randn(rows, depth, device="cuda").to(dtype)
        want = gate_up_silu_reference(x, weight).float()
        for block_n in op.BLOCK_N_CHOICES:
            got = kernels.gate_up_silu(x, weight, block_n).float()
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    separate = lambda rows: _separate(rows, weight)  # noqa: E731
    why, block_n = self_check(kernels, weight, 1, separate, op.cuda_graph_microseconds)
    print(f"gate_up_silu {shape} {dtype}: {why or 'serves'}, block {block_n}")
    assert why is None or "us against" in why
