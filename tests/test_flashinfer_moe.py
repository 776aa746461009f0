"""FlashInfer's fused MoE kernel (cutlass_fused_moe) for the experts on
CUDA, checked on CPU through tests/fake_flashinfer.py: the fake computes
the kernel's documented semantics (fc1 rows [up | gate], routing weights
applied in the final sum) and raises `KernelFault` wherever the real kernel
would fault or read the wrong bytes. The real kernel runs in the gpu-marked
tests at the end (skipped, saying why, where it does not build: the
project's trimmed GPU bundle lacks its sources).

What is proven here: a Qwen3-MoE and a Mixtral whose sizes meet the
contract take the kernel (the report says so, the fake is called) and give
the greedy tokens of the grouped torch form; the tiny MoE shapes, and each
violation of the contract, stay in torch and never reach the kernel; a
kernel that reads the weights otherwise (gate and up swapped), ignores the
routing weights or fails to build is caught by the self-check, the layer
falls back, and the tokens are unchanged."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.llm import GenerationOutput
from aioserve.cpu import elementwise as native_elementwise
from aioserve.cpu_engine.fast_paths import CpuFastPaths
from aioserve.flashinfer import contracts
from aioserve.flashinfer import elementwise as flashinfer_elementwise
from aioserve.flashinfer import gate_up_silu
from aioserve.flashinfer import loader as flashinfer_loader
from aioserve.flashinfer import moe as flashinfer_moe
from aioserve.layers.moe import FusedMoE, grouped_experts
from fake_flashinfer import KernelFault, fake_flashinfer
from tiny_models import build_checkpoint

DTYPE = torch.bfloat16
fake_moe = fake_flashinfer.fused_moe.cutlass_fused_moe


def with_moe_kernel(kernel) -> SimpleNamespace:
    """The fake FlashInfer with `kernel` as its cutlass_fused_moe."""
    return SimpleNamespace(**{**vars(fake_flashinfer), "fused_moe": SimpleNamespace(cutlass_fused_moe=kernel)})


class Recording:
    """A kernel stand-in that counts its calls."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.kernel(*args, **kwargs)


def swapped_gate_up(x, ids, scales, fc1, fc2, *args, **kwargs):
    """A kernel that reads fc1 as [gate | up] (what aioserve's w13 holds)."""
    inter = fc1.shape[1] // 2
    return fake_moe(x, ids, scales, torch.cat((fc1[:, inter:], fc1[:, :inter]), dim=1), fc2, *args, **kwargs)


def unweighted(x, ids, scales, fc1, fc2, *args, **kwargs):
    """A kernel that sums the k expert outputs without the routing weights."""
    return fake_moe(x, ids, torch.ones_like(scales), fc1, fc2, *args, **kwargs)


def not_built(*args, **kwargs):
    # FlashInfer's JIT failure as it reads: the cause lines below the first.
    raise RuntimeError(
        "Ninja build failed. Ninja output:\n[1/12] nvcc -c fused_moe_90/cutlass_fused_moe_kernels.cu\n"
        "FAILED: cutlass_fused_moe_kernels.cuda.o\n"
        "nvcc fatal   : Could not open input file 'csrc/fused_moe/cutlass_fused_moe_kernels.cu': No such file or directory\n"
        "ninja: build stopped: subcommand failed."
    )


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """FlashInfer's paths taken on CPU tensors, through the fake; returns a
    function that installs a MoE kernel stand-in (recording its calls)."""
    monkeypatch.setattr(native_elementwise, "ENABLED", False)  # the CPU path would take the elementwise calls
    monkeypatch.setattr(flashinfer_elementwise, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(flashinfer_loader.FLASHINFER, "tried", True)
    monkeypatch.setattr(gate_up_silu.KERNEL, "module", None)  # no Triton kernel on CPU tensors
    monkeypatch.setattr(gate_up_silu.KERNEL, "tried", True)
    # The experts stay stacked, as on CUDA (the CPU would pack them for its native matmul).
    monkeypatch.setattr(CpuFastPaths, "_pack_experts", lambda self: None)

    def install(kernel=fake_moe) -> Recording:
        recording = Recording(kernel)
        monkeypatch.setattr(flashinfer_loader.FLASHINFER, "module", with_moe_kernel(recording))
        flashinfer_elementwise.forget_decisions()
        return recording

    install()
    yield install
    flashinfer_elementwise.forget_decisions()


# -- whole models through the public API ------------------------------------------------------

# Sizes the contract admits: hidden and expert intermediate 128, 8 and 4 experts, top-2.
ADMITTED = {
    "qwen3-moe": {"hidden_size": 128, "moe_intermediate_size": 128},
    "mixtral": {"hidden_size": 128, "intermediate_size": 128},
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused-moe")
    built = {name: build_checkpoint(name, root / name, overrides=fields) for name, fields in ADMITTED.items()}
    built["tiny-qwen3-moe"] = build_checkpoint("qwen3-moe", root / "tiny")  # hidden 64, expert intermediate 32
    return built


# Natural-log units: what bfloat16 rounding moves a logprob by at most, here.
BF16_TOLERANCE = 0.1


def generate(model: Path, **options) -> tuple[list[GenerationOutput], list[FusedMoE]]:
    # On the CPU unless told otherwise: the fake kernel computes there, also on a CUDA host.
    options = {"device": "cpu", "cpu_half_compute": "native", "cuda_graph": False, **options}
    llm = LLM(str(model), dtype="bfloat16", **options)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
        outputs = llm.generate([[1, 5, 9, 13, 17, 21, 25], [1, 2, 3], [7, 3, 11, 2]], params)
        return outputs, [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]
    finally:
        llm.close()


def tokens(outputs: list[GenerationOutput]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def torch_form_outputs(model: Path, monkeypatch: pytest.MonkeyPatch, **options) -> list[GenerationOutput]:
    with monkeypatch.context() as patch:
        patch.setattr(flashinfer_moe, "ENABLED", False)
        outputs, layers = generate(model, **options)
    assert not any(layer.flashinfer.up_first for layer in layers)
    return outputs


def assert_same_greedy_up_to_a_near_tie(got: list[GenerationOutput], reference: list[GenerationOutput]) -> None:
    """Token for token, logprobs within bfloat16's rounding; where the two
    differ (the kernel sums its k outputs in float32, the torch form in
    bfloat16), the kernel's token must be a near-tie of the reference's
    argmax, and the sequences are compared no further."""
    for g, r in zip(got, reference, strict=True):
        for step, (token, expected) in enumerate(zip(g.token_ids, r.token_ids, strict=True)):
            if token != expected:
                top = dict(r.top_logprobs[step] or [])
                assert token in top and top[expected] - top[token] < BF16_TOLERANCE, f"step {step}: not a near-tie"
                break
            assert abs(g.logprobs[step] - r.logprobs[step]) < BF16_TOLERANCE, f"step {step}: logprob"


@pytest.mark.parametrize("arch", sorted(ADMITTED))
def test_admitted_models_take_the_kernel_with_the_same_tokens(
    arch: str, moe_checkpoints: dict[str, Path], fused_on_cpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = torch_form_outputs(moe_checkpoints[arch], monkeypatch)
    kernel = fused_on_cpu()
    outputs, layers = generate(moe_checkpoints[arch])
    assert_same_greedy_up_to_a_near_tie(outputs, reference)
    assert flashinfer_elementwise.report()["fused_moe"] == {"fused": True, "fell_back": []}
    assert layers and all(layer.flashinfer.chosen and layer.flashinfer.up_first for layer in layers)
    assert kernel.calls > len(layers)  # the self-check once, then every step of every sparse layer


@pytest.mark.parametrize("wrong", [swapped_gate_up, unweighted, not_built], ids=lambda f: f.__name__)
def test_the_self_check_catches_a_kernel_that_computes_otherwise(
    wrong, moe_checkpoints: dict[str, Path], fused_on_cpu, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = moe_checkpoints["qwen3-moe"]
    reference = torch_form_outputs(model, monkeypatch)
    kernel = fused_on_cpu(wrong)
    with caplog.at_level(logging.INFO, logger=flashinfer_moe.__name__):
        outputs, layers = generate(model)
    assert tokens(outputs) == tokens(reference)  # all in torch: exactly
    assert kernel.calls == 1  # the self-check, once for the model's one expert shape
    report = flashinfer_elementwise.report()["fused_moe"]
    assert not report["fused"] and len(report["fell_back"]) == 1
    # A build failure's reason names its cause (the line that says what failed), not its opening line.
    expected = "did not run (RuntimeError: nvcc fatal" if wrong is not_built else "differs from the grouped torch form"
    assert expected in report["fell_back"][0]
    assert not any(layer.flashinfer.up_first for layer in layers)  # w13 left in [gate | up]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "fused_moe" in r.getMessage()]
    assert len(warned) == 1


def test_tiny_shapes_never_reach_the_kernel(moe_checkpoints: dict[str, Path], fused_on_cpu, monkeypatch) -> None:
    """hidden 64 and expert intermediate 32 are not multiples of 128: torch serves them."""
    model = moe_checkpoints["tiny-qwen3-moe"]
    reference = torch_form_outputs(model, monkeypatch)
    kernel = fused_on_cpu()
    outputs, layers = generate(model)
    assert tokens(outputs) == tokens(reference) and kernel.calls == 0
    report = flashinfer_elementwise.report()["fused_moe"]
    assert report["fused"] is False and "multiples of 128" in report["fell_back"][0]
    assert all(layer.flashinfer.chosen is False for layer in layers)


def test_a_dense_model_reports_no_moe_op(fused_on_cpu, stories_path: Path) -> None:
    LLM(str(stories_path), dtype="bfloat16", device="cpu", cpu_half_compute="native", cuda_graph=False).close()
    assert "fused_moe" not in flashinfer_elementwise.report()


# -- one layer ---------------------------------------------------------------------------------


def random_layer(experts: int = 4, hidden: int = 128, inter: int = 128) -> FusedMoE:
    gen = torch.Generator().manual_seed(3)
    layer = FusedMoE(experts, hidden, inter).to(DTYPE)
    layer.w13.data.copy_(torch.randn(layer.w13.shape, generator=gen) * hidden**-0.5)
    layer.w2.data.copy_(torch.randn(layer.w2.shape, generator=gen) * inter**-0.5)
    return layer


def routing(tokens: int, experts: int, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=gen), -1).topk(k, dim=-1)
    return weights, ids


def test_a_chosen_layer_keeps_one_reordered_copy_and_its_torch_form(fused_on_cpu) -> None:
    layer = random_layer()
    x = torch.randn(6, 128).to(DTYPE)
    weights, ids = routing(6, 4)
    gate_up = layer.w13.data.clone()
    reference = grouped_experts(x, weights, ids, layer.w13.data, layer.w2.data)
    with torch.inference_mode():
        fused = layer(x, weights, ids)
    assert layer.flashinfer.up_first
    # Reordered in place: the parameter's storage is the same, its halves swapped.
    assert torch.equal(layer.w13.data, torch.cat((gate_up[:, 128:], gate_up[:, :128]), dim=1))
    torch.testing.assert_close(fused.float(), reference.float(), atol=0.02, rtol=0.02)
    # A layout the contract refuses (a strided x) runs the torch form over the reordered stack.
    strided = torch.zeros(6, 256, dtype=DTYPE)[:, :128]
    strided.copy_(x)
    with torch.inference_mode():
        assert torch.equal(layer(strided, weights, ids), reference)


def test_disabled_or_float32_stays_in_torch(fused_on_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = fused_on_cpu()
    layer = random_layer().float()
    weights, ids = routing(3, 4)
    with torch.inference_mode():
        layer(torch.randn(3, 128), weights, ids)
    monkeypatch.setattr(flashinfer_moe, "ENABLED", False)
    half = random_layer()
    with torch.inference_mode():
        half(torch.randn(3, 128).to(DTYPE), weights, ids)
    assert kernel.calls == 0 and layer.flashinfer.chosen is None and half.flashinfer.chosen is None


# -- the contract against the kernel model -----------------------------------------------------


def offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """t's values at a data pointer `elements` past an aligned one."""
    buffer = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = buffer[elements:].view(t.shape)
    view.copy_(t)
    return view


def moe_args(hidden: int = 128, inter: int = 128, experts: int = 4, dtype: torch.dtype = DTYPE) -> dict:
    weights, ids = routing(5, experts)
    return dict(
        x=torch.randn(5, hidden).to(dtype), ids=ids.to(torch.int32), scales=weights,
        fc1=torch.randn(experts, 2 * inter, hidden).to(dtype), fc2=torch.randn(experts, hidden, inter).to(dtype),
    )


def changed(**changes) -> dict:
    args = moe_args(**{k: changes.pop(k) for k in ("hidden", "inter", "dtype") if k in changes})
    for name, change in changes.items():
        args[name] = change(args[name])
    return args


VIOLATIONS = {
    "expert intermediate 100 (200-byte rows)": lambda: changed(inter=100),
    "hidden 100": lambda: changed(hidden=100),
    "x 2 bytes off": lambda: changed(x=lambda t: offset(t, 1)),
    "x a strided view": lambda: changed(x=lambda t: torch.cat((t, t), dim=1)[:, :128]),
    "fc1 a transposed view": lambda: changed(fc1=lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
    "fp16 weights under bf16 x": lambda: changed(fc1=lambda t: t.half(), fc2=lambda t: t.half()),
    "float32 throughout": lambda: changed(dtype=torch.float32),
    "int64 expert ids": lambda: changed(ids=lambda t: t.long()),
    "bf16 routing weights": lambda: changed(scales=lambda t: t.to(DTYPE)),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_each_violation_is_refused_by_the_contract_and_faults_in_the_kernel_model(case: str) -> None:
    a = VIOLATIONS[case]()
    assert contracts.fused_moe(a["x"], a["ids"], a["scales"], a["fc1"], a["fc2"]) is not None
    with pytest.raises(KernelFault):
        fake_moe(a["x"], a["ids"], a["scales"], a["fc1"], a["fc2"], a["x"].dtype, quant_scales=None)


def test_the_contract_never_admits_what_the_kernel_model_faults_on() -> None:
    """Sizes, dtypes and pointer offsets mixed: whatever the contract admits
    runs in the model without a fault (and some of it is admitted)."""
    admitted = 0
    for hidden in (64, 100, 128, 256):
        for inter in (32, 100, 128, 384):
            for skip in (0, 1, 8):
                for dtype in (DTYPE, torch.float16):
                    a = changed(hidden=hidden, inter=inter, dtype=dtype, x=lambda t: offset(t, skip))
                    if contracts.fused_moe(a["x"], a["ids"], a["scales"], a["fc1"], a["fc2"]) is None:
                        admitted += 1
                        (out,) = fake_moe(a["x"], a["ids"], a["scales"], a["fc1"], a["fc2"], dtype, quant_scales=None)
                        assert out.shape == a["x"].shape and out.dtype == dtype
    assert admitted == 16  # hidden 128/256 x intermediate 128/384 x pointers 0 or 16 bytes in x both half types


# -- the real kernel ---------------------------------------------------------------------------


def skip_if_not_built(why: str | None) -> None:
    """The project's trimmed GPU bundle does not carry the kernel's sources:
    there it cannot build, and the layers rightly keep the torch form."""
    if why is not None and why.startswith("the kernel did not run"):
        pytest.skip(f"FlashInfer's fused MoE kernel is not available here: {why}")


@pytest.mark.gpu
def test_the_real_kernel_matches_the_torch_form_on_cuda() -> None:
    """On an H100: the self-check passes; the kernel over aioserve's
    [gate | up] order, unswapped, is far off (so the check discriminates);
    a layer that took the kernel agrees with the grouped torch form."""
    fi = pytest.importorskip("flashinfer")
    layer = random_layer(experts=8, hidden=256, inter=512).cuda()
    w13, w2 = layer.w13.data, layer.w2.data
    why = flashinfer_moe.self_check(fi, w13, w2, grouped_experts)
    skip_if_not_built(why)
    assert why is None
    x = torch.randn(40, 256).to(DTYPE).cuda()
    weights, ids = (t.cuda() for t in routing(40, 8))
    reference = grouped_experts(x, weights, ids, w13, w2).float()
    unswapped = flashinfer_moe.run_kernel(fi, x, ids.int(), weights.float(), w13, w2).float()
    assert (unswapped - reference).norm() > flashinfer_moe.SELF_CHECK_TOLERANCE * reference.norm()
    flashinfer_elementwise.forget_decisions()
    assert layer.choose_kernel()
    with torch.inference_mode():
        out = layer(x, weights, ids)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference, atol=0.03, rtol=0.03)
    assert flashinfer_elementwise.report()["fused_moe"]["fused"]


@pytest.mark.gpu
def test_an_admitted_model_takes_the_real_kernel_under_cuda_graphs(
    moe_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-MoE (hidden 128, 8 experts) on CUDA with decode graphs: the
    kernel is chosen at load, captured, and follows the grouped form's greedy."""
    pytest.importorskip("flashinfer")
    model = moe_checkpoints["qwen3-moe"]
    reference = torch_form_outputs(model, monkeypatch, device="cuda", cuda_graph=True)
    flashinfer_elementwise.forget_decisions()
    outputs, layers = generate(model, device="cuda", cuda_graph=True)
    report = flashinfer_elementwise.report()["fused_moe"]
    skip_if_not_built(report["fell_back"][0] if report["fell_back"] else None)
    assert report == {"fused": True, "fell_back": []}, report
    assert all(layer.flashinfer.up_first for layer in layers)
    assert_same_greedy_up_to_a_near_tie(outputs, reference)
