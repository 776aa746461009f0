"""Block-scaled FP8 checkpoints (128 x 128 `weight_scale_inv`, the Qwen3-FP8
layout) multiplied as FP8 on CUDA (quant/fp8_block_linear.py,
quant/fp8_layers.py), proven on the CPU:

- the contract accepts what torch's 1x128 x 128x128 scaled_mm takes and
  names the reason for each thing it does not, torch's own layout checks
  run on meta tensors of the operands the layer builds;
- a CPU reference of that scaled_mm, written from its definition and
  refusing any operand torch's checks refuse, given the exact tensors the
  layer passes, equals the dequantised product within FP8's error (so the
  activation quantisation, the scale layouts and the transposes are right);
- tensor-parallel shards and fused q/k/v, gate/up parts load their own block
  scales; pieces off a 128 boundary keep the dequantised form;
- a tiny block-scaled checkpoint loads into the held form (the reference
  standing in for the GPU kernel) and its greedy output through
  `aioserve.LLM` equals transformers on the dequantised twin with the same
  activation quantisation;
- the self-check dequantises a layer whose FP8 product is wrong or raises.

The real kernel on a GPU: `test_block_fp8_on_cuda` (gpu-marked)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aioserve import LLM, SamplingParams
from aioserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from aioserve.models.model_config import ModelConfig
from aioserve.models.weight_loader import build_model
from aioserve.quant import fp8_block_linear, fp8_layers
from aioserve.quant.fp8_block_linear import block_fp8_linear, block_scaled_mm_reason, scale_columns
from aioserve.quant.fp8_loading import load_block_scale
from aioserve.tp.distributed import TPGroup, tp_group_as
from fp8_checkpoints import BLOCK, QUANTISED, build_fp8_checkpoints, dequantize, fake_quantise_activations, quantize
from fp8_checkpoints import cuda_logprob_gap, held_fp8_linears, reference_scaled_mm
from hf_reference import hf_encode, hf_greedy
from test_greedy_matches_hf import PROMPTS

CUDA = torch.device("cuda")
# Every linear layer's dims a multiple of 128 (q, k, v: 2 heads of 64 each;
# down_proj's K of 256 is 2 blocks, its scales padded to 4 columns).
SHAPES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
          "head_dim": 64}
# FP8 error of a product whose activations and weights are both e4m3 (3
# mantissa bits: 1/16 per value at worst), relative to the largest output.
FP8_TOLERANCE = 0.06


@pytest.fixture
def on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device half of the contract answered as an H100 would (the layout half runs for real)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8_block_linear._layout_reason.cache_clear()


@pytest.fixture
def reference_kernel(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    """The CPU reference standing in for torch's scaled_mm; the calls' operands, recorded."""
    calls: list[tuple[torch.Tensor, ...]] = []

    def recorded(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, ra: object, sb: torch.Tensor, rb: object,
                 **kwargs: object) -> torch.Tensor:
        calls.append((a, b, sa, sb))
        return reference_scaled_mm(a, b, sa, ra, sb, rb, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", recorded)
    return calls


@pytest.mark.parametrize("k, n", [(128, 128), (256, 512), (384, 256), (4096, 12288), (12288, 4096)])
def test_contract_accepts_block_aligned_weights(on_hopper: None, k: int, n: int) -> None:
    assert block_scaled_mm_reason(CUDA, torch.bfloat16, k, n) is None


@pytest.mark.parametrize(
    "device, capability, dtype, k, n, reason",
    [
        (torch.device("cpu"), (9, 0), torch.bfloat16, 128, 128, "run on CUDA, not cpu"),
        (CUDA, (8, 0), torch.bfloat16, 128, 128, "compute capability 9.x"),
        (CUDA, (10, 0), torch.bfloat16, 128, 128, "this GPU has (10, 0)"),
        (CUDA, (9, 0), torch.float16, 128, 128, "write bfloat16, not torch.float16"),
        (CUDA, (9, 0), torch.bfloat16, 192, 128, "multiples of 128"),
        (CUDA, (9, 0), torch.bfloat16, 128, 200, "multiples of 128"),
    ],
)
def test_contract_names_what_it_refuses(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, capability: tuple[int, int], dtype: torch.dtype,
    k: int, n: int, reason: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert reason in (block_scaled_mm_reason(device, dtype, k, n) or "")


def test_contract_runs_torchs_layout_checks_on_the_layers_own_operands(
    on_hopper: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layout half is torch's meta check of what block_fp8_linear builds:
    activation scales laid out row-major (not the outer-dim-major torch
    wants) are refused, with torch's words."""
    def row_major_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        quantised, scale = original(rows)
        return quantised, scale.contiguous()

    original = fp8_block_linear.quantize_activation_groups
    monkeypatch.setattr(fp8_block_linear, "quantize_activation_groups", row_major_scales)
    reason = block_scaled_mm_reason(CUDA, torch.bfloat16, 256, 256)
    assert reason is not None and "refuses a [256, 256] weight" in reason and "stride" in reason
    fp8_block_linear._layout_reason.cache_clear()


def _held(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scales as a layer holds them [N/128, L4], the dequantised weight)."""
    q, scale = quantize(weight, BLOCK)
    held = torch.ones(scale.shape[0], scale_columns(scale.shape[1]))
    held[:, : scale.shape[1]] = scale
    return q, held, dequantize(q, scale, BLOCK)


@pytest.mark.parametrize("m, k, n", [(1, 128, 256), (7, 384, 128), (5, 512, 384), (3, 256, 128)])
def test_the_operands_passed_multiply_to_the_dequantised_product(
    reference_kernel: list[tuple[torch.Tensor, ...]], m: int, k: int, n: int
) -> None:
    torch.manual_seed(m * k + n)
    x, bias = torch.randn(m, k, dtype=torch.bfloat16) * 3, torch.randn(n, dtype=torch.bfloat16)
    q, held, wide = _held(torch.randn(n, k) * 0.05)
    out = block_fp8_linear(x, q, held, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    a, b, sa, sb = reference_kernel[-1]
    # What reached the kernel: e4m3 activations row-major, the weight's bytes
    # transposed (column-major), scales outer-dim-major, the weight's padded.
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride() == (k, 1) and b.stride() == (1, k)
    assert torch.equal(b.t().view(torch.uint8), q.view(torch.uint8))
    rows = -(-m // 4) * 4  # padded to cuBLASLt's multiple of 4
    assert a.shape == (rows, k) and sa.shape == (rows, k // 128) and sa.stride() == (1, rows)
    assert sb.shape == (scale_columns(k // 128), n // 128) and sb.stride() == (1, scale_columns(k // 128))
    # ... and they mean x W^T: the same quantised activations exactly, the raw ones within FP8's error.
    exact = fake_quantise_activations(x).double() @ wide.double().t() + bias.double()
    assert (out.double() - exact).abs().max() <= 0.01 * exact.abs().max()
    plain = x.double() @ wide.double().t() + bias.double()
    assert (out.double() - plain).abs().max() <= FP8_TOLERANCE * plain.abs().max()


def test_rows_are_padded_to_the_multiple_of_4_cublas_takes(
    reference_kernel: list[tuple[torch.Tensor, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuBLASLt refused a decode row (M = 1) on an H100 though torch's checks
    passed; the reference kernel refuses it too, so the padding is what makes
    a single row run, on CPU as on the GPU."""
    q, held, wide = _held(torch.randn(256, 128) * 0.05)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    out = block_fp8_linear(x, q, held, None)
    assert out.shape == (1, 256) and reference_kernel[-1][0].shape == (4, 128)
    exact = fake_quantise_activations(x).double() @ wide.double().t()
    assert (out.double() - exact).abs().max() <= 0.01 * exact.abs().max()
    monkeypatch.setattr(fp8_block_linear, "CUBLAS_ROW_MULTIPLE", 1)
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        block_fp8_linear(x, q, held, None)


def _split_layers() -> dict[str, torch.nn.Module]:
    """This rank's share of each parallel layer kind, held in FP8 blocks."""
    layers = {
        "col": ColumnParallelLinear(256, 512), "merged": MergedColumnParallelLinear(256, [256, 512]),
        "qkv": QKVParallelLinear(256, 128, 4, 2, bias=False), "row": RowParallelLinear(512, 256),
    }
    for layer in layers.values():
        assert fp8_layers._block_reason(layer, CUDA, torch.bfloat16, forced=True) is None
        fp8_layers.use_fp8_weight(layer, blocks=True)
    return layers


def test_tensor_parallel_shards_and_fused_parts_load_their_block_scales(
    reference_kernel: list[tuple[torch.Tensor, ...]],
) -> None:
    """Over 2 ranks, every layer kind's shards hold the checkpoint's e4m3
    rows and their own scale rows (columns, for the row-parallel layer):
    gathered or summed, they compute the unsharded product."""
    torch.manual_seed(0)
    shapes = {"col": (512, 256), "gate": (256, 256), "up": (512, 256), "q": (512, 256), "k": (256, 256),
              "v": (256, 256), "row": (256, 512)}
    full = {name: quantize(torch.randn(rows, cols) * 0.05, BLOCK) for name, (rows, cols) in shapes.items()}
    parts = {"col": [("col", None)], "merged": [("gate", 0), ("up", 1)], "qkv": [("q", "q"), ("k", "k"), ("v", "v")],
             "row": [("row", None)]}
    x, row_x = torch.randn(3, 256), torch.randn(3, 512)
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in parts}
    for rank in (0, 1):
        with tp_group_as(TPGroup(rank, 2)):
            layers = _split_layers()
            for kind, layer in layers.items():
                for name, shard in parts[kind]:
                    q, grid = full[name]
                    layer.load_weight("weight", q, shard)
                    load_block_scale(layer, grid, q.shape, shard)
        for kind, layer in layers.items():
            inputs = row_x[:, rank * 256 : (rank + 1) * 256] if kind == "row" else x
            outputs[kind].append(layer.matmul(inputs))
    wide = {name: dequantize(q, grid, BLOCK) for name, (q, grid) in full.items()}
    quantised, quantised_row = fake_quantise_activations(x), fake_quantise_activations(row_x)
    expected = {
        "col": [quantised @ wide["col"].t()],
        "merged": [quantised @ wide["gate"].t(), quantised @ wide["up"].t()],
        "qkv": [quantised @ wide[p].t() for p in "qkv"],
    }
    for kind, sizes in {"col": [512], "merged": [256, 512], "qkv": [512, 256, 256]}.items():
        # Rank r holds [part0 shard r | part1 shard r | ...]: regroup the parts across ranks.
        per_rank = [out.split([s // 2 for s in sizes], dim=1) for out in outputs[kind]]
        for index, want in enumerate(expected[kind]):
            got = torch.cat([pieces[index] for pieces in per_rank], dim=1)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Row-parallel: each rank multiplies its 256 input columns; the partial products sum to the whole.
    torch.testing.assert_close(outputs["row"][0] + outputs["row"][1], quantised_row @ wide["row"].t(),
                               atol=1e-4, rtol=1e-4)


def test_pieces_off_a_block_boundary_stay_dequantised() -> None:
    with tp_group_as(TPGroup(0, 2)):
        one_kv_head = QKVParallelLinear(128, 64, 2, 1, bias=False)  # k and v: 64 rows each (replicated)
        shard_of_192 = ColumnParallelLinear(128, 384)
        row_shard_of_192 = RowParallelLinear(384, 128)
    for layer in (one_kv_head, shard_of_192, row_shard_of_192):
        reason = fp8_layers._block_reason(layer, CUDA, torch.bfloat16, forced=True)
        assert reason is not None and "do not all fall on 128-row/column blocks" in reason


def test_a_bad_block_scale_grid_is_refused() -> None:
    layer = ColumnParallelLinear(256, 256)
    fp8_layers.use_fp8_weight(layer, blocks=True)
    with pytest.raises(ValueError, match=r"block scales of \(2, 1\) for a \[256, 256\] weight"):
        load_block_scale(layer, torch.ones(2, 1), torch.Size([256, 256]), None)


@pytest.fixture(scope="module")
def block_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_fp8_checkpoints("qwen3", tmp_path_factory.mktemp("fp8-block"), BLOCK, SHAPES)


def _hf_with_quantised_activations(path: Path) -> torch.nn.Module:
    """transformers on the dequantised weights, each FP8 projection's input
    rounded as the FP8 GEMM rounds it (per token, per 128 columns, to e4m3)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTISED:
            module.register_forward_pre_hook(lambda _, args: (fake_quantise_activations(args[0]),))
    return model


def test_block_checkpoint_held_in_fp8_matches_transformers(
    block_checkpoint: tuple[Path, Path], on_hopper: None, reference_kernel: list[tuple[torch.Tensor, ...]],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The held path end to end on the CPU: the contract's device half
    answered yes (on_hopper; the layout half still runs) and the reference
    kernel standing in for the GPU's. Every linear layer holds the
    checkpoint's e4m3 bytes and block scales, passes its self-check, and
    greedy decoding equals transformers on the dequantised weights with the
    same activation rounding, token for token."""
    from safetensors.torch import load_file

    fp8, reference = block_checkpoint
    monkeypatch.setattr(fp8_layers, "block_scaled_mm_reason",
                        lambda device, dtype, k, n: block_scaled_mm_reason(CUDA, torch.bfloat16, k, n))
    with caplog.at_level(logging.INFO, logger="aioserve.quant.fp8_layers"):
        llm = LLM(str(fp8), page_size=4, device="cpu")  # the reference kernel computes there
    try:
        assert "8 linear layers multiply in FP8" in caplog.text and "self-check" not in caplog.text
        held = held_fp8_linears(llm.engine.model)
        assert len(held) == 4 * llm.engine.model_config.num_layers
        tensors = load_file(fp8 / "model.safetensors")
        down = held["model.layers.1.mlp.down_proj"]
        raw = tensors["model.layers.1.mlp.down_proj.weight"]
        assert torch.equal(down.weight.view(torch.uint8), raw.view(torch.uint8))
        assert torch.equal(down.weight_scale[:, :2], tensors["model.layers.1.mlp.down_proj.weight_scale_inv"])
        gate_up = held["model.layers.0.mlp.gate_up_proj"]
        scales = [tensors[f"model.layers.0.mlp.{p}_proj.weight_scale_inv"] for p in ("gate", "up")]
        assert torch.equal(gate_up.weight_scale[:, :1], torch.cat(scales))
        calls = len(reference_kernel)
        oracle = _hf_with_quantised_activations(reference)
        prompts = [hf_encode(reference, p) for p in PROMPTS]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
        for ids, out in zip(prompts, llm.generate(prompts, params)):
            expected, logprobs = hf_greedy(reference, ids, 12, model=oracle)
            assert out.token_ids == expected
            assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4
        assert len(reference_kernel) > calls  # the steps multiplied through the (stand-in) FP8 kernel
    finally:
        llm.close()


def test_a_wide_part_and_dummy_weights_are_quantised_in_blocks(
    block_checkpoint: tuple[Path, Path], reference_kernel: list[tuple[torch.Tensor, ...]], tmp_path: Path
) -> None:
    """A wide part of a fused layer whose other part the block-scaled
    checkpoint stores in FP8 (gate of gate/up) is quantised per 128 x 128
    block at load; a layer it left wide altogether stays wide; `--load-format
    dummy` fills held layers alike. The held ones pass the self-check."""
    import shutil

    from safetensors.torch import load_file, save_file

    fp8, reference = block_checkpoint
    folder = tmp_path / "some-wide"
    shutil.copytree(fp8, folder)
    tensors = load_file(folder / "model.safetensors")
    wide_tensors = load_file(reference / "model.safetensors")
    gate, down = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"
    for name in (gate, down):
        tensors[name] = wide_tensors[name]
        del tensors[name + "_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = ModelConfig.from_path(folder)
    cpu = torch.device("cpu")
    model = build_model(config, folder, torch.float32, cpu, "auto", 0, fp8_matmul="force")
    held = held_fp8_linears(model)
    assert "model.layers.1.mlp.down_proj" not in held
    assert torch.equal(model.get_submodule("model.layers.1.mlp.down_proj").weight, wide_tensors[down])
    gate_up = held["model.layers.1.mlp.gate_up_proj"]
    wide = wide_tensors[gate]  # [256, 128]: rows 0-255 of gate/up, 2 x 1 blocks
    blocks = wide.reshape(2, 128, 1, 128).abs().amax(dim=(1, 3))
    torch.testing.assert_close(gate_up.weight_scale[:2, :1], blocks / 448)
    restored = dequantize(gate_up.weight[:256], gate_up.weight_scale[:2, :1], BLOCK)
    assert (restored - wide).abs().max() <= 0.07 * wide.abs().max()
    dummy = build_model(config, folder, torch.float32, cpu, "dummy", 0, fp8_matmul="force")
    held = held_fp8_linears(dummy)
    assert len(held) == 4 * config.num_layers
    for layer in held.values():
        used = layer.weight_scale[:, : layer.weight.shape[1] // 128]
        assert used.min() > 0 and torch.all(layer.weight_scale[:, used.shape[1]:] == 1)
        assert layer.weight.float().abs().amax() == 448  # each block's largest maps to e4m3's largest


@pytest.mark.parametrize("fault", ["raises", "wrong"])
def test_self_check_dequantises_a_layer_whose_fp8_product_fails(
    block_checkpoint: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    """A kernel that raises, or computes without reading the weight's block
    scales, fails the self-check
    at load: every layer is dequantised in place (the values the dequantised
    twin holds), with one warning naming the reason."""
    from safetensors.torch import load_file

    def faulty(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, ra: object, sb: torch.Tensor, rb: object,
               **kwargs: object) -> torch.Tensor:
        if fault == "raises":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return reference_scaled_mm(a, b, sa, ra, torch.ones_like(sb), rb, **kwargs)  # the weight scales unread

    monkeypatch.setattr(F, "scaled_mm", faulty)
    fp8, reference = block_checkpoint
    config = ModelConfig.from_path(fp8)
    with caplog.at_level(logging.WARNING, logger="aioserve.quant.fp8_layers"):
        model = build_model(config, fp8, torch.float32, torch.device("cpu"), "auto", 0, fp8_matmul="force")
    assert not held_fp8_linears(model)
    reason = "CUBLAS_STATUS_NOT_SUPPORTED" if fault == "raises" else "off the dequantised one by more than 2%"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    twin = load_file(reference / "model.safetensors")
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
    assert o_proj.weight.dtype == torch.float32
    assert torch.equal(o_proj.weight, twin["model.layers.0.self_attn.o_proj.weight"])


@pytest.mark.gpu
def test_block_fp8_on_cuda(block_checkpoint: tuple[Path, Path]) -> None:
    """On a Hopper GPU: torch's block-scaled scaled_mm, given the layer's
    operands, equals the CPU reference; the block-scaled checkpoint's linear
    layers hold FP8 and pass their self-check; its prompt logprobs stay
    within FP8's error of the dequantised twin's, and greedy decoding runs
    (CUDA graphs included)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch's 1x128 x 128x128 scaled_mm runs on compute capability 9.x")
    torch.manual_seed(0)
    for m, k, n in [(1, 128, 256), (7, 384, 128), (33, 4096, 1024)]:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        q, held, _ = _held(torch.randn(n, k) * 0.05)
        got = block_fp8_linear(x.to(CUDA), q.to(CUDA), held.to(CUDA), None).cpu().double()
        # The reference refuses M = 1 and 7 as cuBLASLt does: it gets the
        # rows padded to a multiple of 4, as block_fp8_linear pads them.
        padded = F.pad(x, (0, 0, 0, -m % fp8_block_linear.CUBLAS_ROW_MULTIPLE))
        quantised, x_scale = fp8_block_linear.quantize_activation_groups(padded)
        expected = reference_scaled_mm(quantised, q.t(), x_scale, F.ScalingType.BlockWise1x128, held.t(),
                                       F.ScalingType.BlockWise128x128)[:m].double()
        assert (got - expected).abs().max() <= 0.01 * expected.abs().max(), (m, k, n)
    fp8, reference = block_checkpoint
    gap = cuda_logprob_gap(fp8, reference, hf_encode(reference, PROMPTS[4]), scale_dims=2)
    assert gap < 0.1, gap
