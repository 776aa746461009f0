"""FP8 checkpoints (quantization_config fp8, e4m3 weights): written by the
tests with one scale per tensor and with 128 x 128 block scales (a dense
Qwen3 and a Qwen3-MoE whose experts are quantised too), they load
dequantised on the CPU and their greedy output equals transformers run on
the same weights dequantised, offline and over HTTP; a quantisation
aioserve cannot run fails at load naming the format. The CUDA path's
layers (FP8 weights, row scales, torch._scaled_mm) are built and checked on
the CPU; the engine on a GPU runs in the gpu-marked test. Block scales held
in FP8: tests/test_fp8_block_gemm.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from aioserve import LLM
from fp8_checkpoints import (BLOCK, build_fp8_checkpoints, check_completion_over_http, check_held_products,
                            cuda_logprob_gap, dequantize, held_fp8_linears, quantize, with_quantization)
from hf_reference import hf_encode
from test_greedy_matches_hf import PROMPTS, check_against_hf

# Shapes whose 128 x 128 blocks are partial at the edges and more than one along a dim.
OVERRIDES = {"intermediate_size": 192}
CASES = {"qwen3-per-tensor": ("qwen3", None, OVERRIDES), "qwen3-moe-block": ("qwen3-moe", BLOCK, {"moe_intermediate_size": 160})}


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("fp8")
    return {case: build_fp8_checkpoints(name, root / case, block, extra) for case, (name, block, extra) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_greedy_matches_transformers_on_dequantised_weights(
    case: str, fp8_checkpoints: dict[str, tuple[Path, Path]]
) -> None:
    fp8, reference = fp8_checkpoints[case]
    llm = LLM(str(fp8), page_size=4)
    try:
        assert llm.engine.model_config.quantization is not None
        assert llm.engine.model_config.quantization.block == CASES[case][1]
        check_against_hf(reference, llm, [hf_encode(reference, p) for p in PROMPTS])
    finally:
        llm.close()


def test_fp8_over_http(fp8_checkpoints: dict[str, tuple[Path, Path]]) -> None:
    fp8, reference = fp8_checkpoints["qwen3-moe-block"]
    check_completion_over_http(fp8, reference, PROMPTS[1])


def test_quantize_round_trip() -> None:
    """The test's own quantiser: block and per-tensor scales reproduce the
    weight to e4m3's precision (so the checkpoints above mean what they say)."""
    torch.manual_seed(0)
    w = torch.randn(200, 300)
    for block in (None, BLOCK):
        q, scale = quantize(w, block)
        assert q.dtype == torch.float8_e4m3fn
        assert scale.shape == (() if block is None else (2, 3))
        assert (dequantize(q, scale, block) - w).abs().max() < 0.07 * w.abs().max()


@pytest.mark.parametrize(
    "quantization, named",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
    ],
)
def test_unsupported_quantisation_fails_at_load_naming_it(
    quantization: dict, named: str, fp8_checkpoints: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    _, reference = fp8_checkpoints["qwen3-per-tensor"]
    folder = with_quantization(reference, tmp_path / "quantised", quantization)
    with pytest.raises(ValueError, match=named):
        LLM(str(folder))


def test_fp8_weight_without_its_scale_is_refused(fp8_checkpoints: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    fp8, _ = fp8_checkpoints["qwen3-per-tensor"]
    folder = tmp_path / "no-scale"
    shutil.copytree(fp8, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj.weight has no scale"):
        LLM(str(folder))


def test_weights_held_in_fp8_are_the_checkpoints_and_multiply_like_the_dequantised(
    fp8_checkpoints: dict[str, tuple[Path, Path]],
) -> None:
    """The CUDA path's layers (quant/fp8_linear.py), built on the CPU (whose
    torch._scaled_mm takes row-wise scales too): every linear layer holds the
    checkpoint's e4m3 bytes and its per-tensor scale on every row, and
    multiplies within FP8's error of the dequantised layer."""
    from safetensors.torch import load_file

    from aioserve.models.model_config import ModelConfig
    from aioserve.models.weight_loader import build_model

    fp8, _ = fp8_checkpoints["qwen3-per-tensor"]
    config = ModelConfig.from_path(fp8)
    cpu = torch.device("cpu")
    held = build_model(config, fp8, torch.float32, cpu, "auto", 0, fp8_matmul="force")
    wide = build_model(config, fp8, torch.float32, cpu, "auto", 0, fp8_matmul="off")
    tensors = load_file(fp8 / "model.safetensors")
    prefix = "model.layers.0.self_attn."
    qkv = held.get_submodule(prefix + "qkv_proj")
    raw = torch.cat([tensors[prefix + p + "_proj.weight"] for p in "qkv"])
    assert qkv.weight.dtype == torch.float8_e4m3fn and torch.equal(qkv.weight.view(torch.uint8), raw.view(torch.uint8))
    scales = torch.cat([tensors[prefix + p + "_proj.weight_scale"].expand(tensors[prefix + p + "_proj.weight"].shape[0])
                        for p in "qkv"])
    assert torch.equal(qkv.weight_scale, scales)
    check_held_products(held, wide)
    assert len(held_fp8_linears(held)) == 4 * config.num_layers


def test_wide_weights_in_an_fp8_checkpoint_stay_wide_or_are_quantised_per_row(
    fp8_checkpoints: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """On the FP8 path: a layer the checkpoint left wide (an ignore list's)
    stays wide; a wide part of a fused layer whose other parts are FP8 (k of
    q/k/v) is quantised per row at load."""
    from safetensors.torch import load_file, save_file

    from aioserve.models.model_config import ModelConfig
    from aioserve.models.weight_loader import build_model

    fp8, reference = fp8_checkpoints["qwen3-per-tensor"]
    folder = tmp_path / "some-wide"
    shutil.copytree(fp8, folder)
    tensors = load_file(folder / "model.safetensors")
    wide_tensors = load_file(reference / "model.safetensors")
    down, k = "model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    for name in (down, k):
        tensors[name] = wide_tensors[name]
        del tensors[name + "_scale"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = build_model(ModelConfig.from_path(folder), folder, torch.float32, torch.device("cpu"), "auto", 0,
                        fp8_matmul="force")
    layer = model.get_submodule("model.layers.1.mlp.down_proj")
    assert layer.weight_scale is None and torch.equal(layer.weight, wide_tensors[down])
    qkv = model.get_submodule("model.layers.1.self_attn.qkv_proj")
    rows = slice(qkv.q_size, qkv.q_size + qkv.kv_size)
    wide = wide_tensors[k]
    assert qkv.weight.dtype == torch.float8_e4m3fn
    assert torch.allclose(qkv.weight_scale[rows], wide.abs().amax(dim=1) / 448)
    restored = qkv.weight[rows].float() * qkv.weight_scale[rows, None]
    assert (restored - wide).abs().max() <= 0.07 * wide.abs().max()


@pytest.mark.gpu
def test_fp8_matmuls_on_cuda(fp8_checkpoints: dict[str, tuple[Path, Path]]) -> None:
    """On a GPU whose scaled matmul takes row-wise scales (Hopper on), the
    per-tensor checkpoint's linear layers multiply in FP8; its prompt
    logprobs stay within FP8's error of the dequantised checkpoint's, and
    greedy decoding runs (CUDA graphs included). The block-scaled MoE
    checkpoint's layers (64 wide: not whole 128 x 128 blocks) stay
    dequantised; block scales in FP8 are test_fp8_block_gemm.py's."""
    fp8, reference = fp8_checkpoints["qwen3-per-tensor"]
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled FP8 GEMMs need compute capability 9.0")
    assert cuda_logprob_gap(fp8, reference, hf_encode(reference, PROMPTS[4]), scale_dims=1) < 0.1
    block, _ = fp8_checkpoints["qwen3-moe-block"]
    llm = LLM(str(block), page_size=16, dtype="bfloat16")
    try:
        assert not held_fp8_linears(llm.engine.model)
    finally:
        llm.close()
