"""FP8 checkpoints in the compressed-tensors format (llm-compressor's output,
the RedHatAI / neuralmagic "-FP8", "-FP8-dynamic" and "-FP8-block" models):
written by the tests with per-tensor, per-channel and 128 x 128 block
`weight_scale`s (a dense Qwen3 and Llama, and a Qwen3-MoE whose experts
are quantised per channel too), the LM head and one MLP projection left
wide by the `ignore` list, and (per-tensor) static `input_scale`s and a
kv_cache_scheme's KV scales that aioserve does not use (it quantises
activations per token; its KV cache is not scaled). Their greedy output equals
transformers run on the same weights dequantised, offline and over HTTP;
`--tp 2` equals `--tp 1` on per-channel scales; every other
compressed-tensors scheme fails at load naming what is unsupported. The
CUDA path's layers with per-channel scales are built and checked on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aioserve import LLM
from aioserve.quant.config import read_quantization
from aioserve.quant.fp8 import Fp8Config
from aioserve.quant.method import UnsupportedQuantization
from fp8_checkpoints import (build_compressed_tensors_checkpoints, check_completion_over_http, check_held_products,
                            compressed_tensors_config, cuda_logprob_gap, held_fp8_linears, with_quantization)
from hf_reference import hf_encode, hf_greedy
from test_greedy_matches_hf import PROMPTS, check_against_hf

# Shapes whose 128 x 128 blocks are partial at the edges and more than one along a dim.
OVERRIDES = {"intermediate_size": 192}
# case -> (tiny model, weight strategy, static input scales in the checkpoint)
CASES = {
    "qwen3-tensor-static": ("qwen3", "tensor", True),
    "qwen3-channel": ("qwen3", "channel", False),
    "llama-channel": ("llama", "channel", False),
    "qwen3-block": ("qwen3", "block", False),
    "qwen3-moe-channel": ("qwen3-moe", "channel", False),  # the experts' per-channel scales too
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("compressed-tensors")
    return {case: build_compressed_tensors_checkpoints(name, root / case, strategy, OVERRIDES if name == "qwen3" else None,
                                                      static)
            for case, (name, strategy, static) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_on_dequantised_weights(case: str, checkpoints: dict[str, tuple[Path, Path]]) -> None:
    fp8, reference = checkpoints[case]
    tensors = load_file(fp8 / "model.safetensors")
    # What the checkpoint holds: e4m3 weights, their scales' shapes, the ignored layer and the head wide.
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    scale = tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    assert q.dtype == torch.float8_e4m3fn
    _, strategy, static = CASES[case]
    expected = {"tensor": (1,), "channel": (q.shape[0], 1), "block": (-(-q.shape[0] // 128), -(-q.shape[1] // 128))}
    assert tuple(scale.shape) == expected[strategy]
    for name in ("q_proj.input_scale", "k_scale", "v_proj.output_scale"):
        assert (f"model.layers.0.self_attn.{name}" in tensors) == static
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32
    down = "model.layers.0.mlp." + ("experts.0.down_proj" if "moe" in case else "down_proj")
    assert tensors[down + ".weight"].dtype == torch.float8_e4m3fn
    assert tensors[down + ".weight_scale"].dim() == len(expected[strategy])
    llm = LLM(str(fp8), page_size=4)
    try:
        config = llm.engine.model_config.quantization
        assert config is not None and (config.method, config.strategy) == ("compressed-tensors", strategy)
        assert config.activation_scheme == ("static" if static else "dynamic")
        check_against_hf(reference, llm, [hf_encode(reference, p) for p in PROMPTS])
    finally:
        llm.close()


def test_early_compression_config_key(checkpoints: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Early compressed-tensors checkpoints name it `compression_config` in config.json."""
    fp8, reference = checkpoints["qwen3-channel"]
    quantization = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    folder = with_quantization(fp8, tmp_path / "early", {})
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps({**config, "compression_config": quantization}))
    llm = LLM(str(folder), page_size=4)
    try:
        assert llm.engine.model_config.quantization is not None and llm.engine.model_config.quantization.strategy == "channel"
        check_against_hf(reference, llm, [hf_encode(reference, PROMPTS[0])])
    finally:
        llm.close()


def test_over_http(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    fp8, reference = checkpoints["qwen3-channel"]
    check_completion_over_http(fp8, reference, PROMPTS[1])


def test_tp2_equals_tp1_with_per_channel_scales(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    """Each rank cuts its rows of the per-channel scales with the weight's
    (q/k/v and gate/up fused), and its columns of down/o (scales whole)."""
    from test_tp_offline import PROMPTS as TP_PROMPTS
    from test_tp_offline import check_tp2_matches_tp1

    fp8, reference = checkpoints["qwen3-channel"]
    got = check_tp2_matches_tp1(fp8)
    for prompt, (tokens, _, _) in zip(TP_PROMPTS[::2], got[::2]):  # the greedy ones
        assert tokens == hf_greedy(reference, prompt, 12)[0]


def _group(weights: dict, activations: dict | None = None, fmt: str | None = None) -> dict:
    return {"targets": ["Linear"], "weights": weights, "input_activations": activations, "format": fmt}


INT4_GROUP = _group({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
                    fmt="pack-quantized")
INT8_W8A8_GROUP = _group({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                         {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
                         fmt="int-quantized")
NVFP4_GROUP = _group({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16},
                     fmt="nvfp4-pack-quantized")


def _ct(*groups: dict, fmt: str = "float-quantized", **extra: object) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}, **extra}


FP8_CHANNEL_GROUP = compressed_tensors_config("channel")["config_groups"]["group_0"]
FP8_BLOCK_GROUP = compressed_tensors_config("block")["config_groups"]["group_0"]


@pytest.mark.parametrize(
    "quantization, named",
    [
        (_ct(INT4_GROUP, fmt="pack-quantized"), r"int4 weights in group 'group_0' \(format 'pack-quantized'\)"),
        (_ct(INT8_W8A8_GROUP, fmt="int-quantized"), r"int8 weights in group 'group_0' \(format 'int-quantized'\)"),
        (_ct(NVFP4_GROUP, fmt="nvfp4-pack-quantized"), r"float4 weights .*'nvfp4-pack-quantized'"),
        (_ct(FP8_CHANNEL_GROUP, INT4_GROUP, fmt="mixed-precision"), r"int4 weights in group 'group_1'"),
        (_ct(FP8_CHANNEL_GROUP, FP8_BLOCK_GROUP),
         r"different FP8 weight strategies \(group_0: channel, group_1: block \[128, 128\]\)"),
        (_ct(FP8_CHANNEL_GROUP, sparsity_config={"format": "sparse-24-bitmask"}), "sparsity"),
        (_ct(_group({**FP8_CHANNEL_GROUP["weights"], "symmetric": False}, fmt="float-quantized")), "asymmetric"),
        (_ct(_group({**FP8_CHANNEL_GROUP["weights"], "strategy": "group", "group_size": 32},
                    fmt="float-quantized")), "strategy 'group'"),
    ],
    ids=["int4-pack", "int8-w8a8", "nvfp4", "fp8-and-int4", "fp8-channel-and-block", "sparse", "asymmetric",
         "fp8-group"],
)
def test_other_compressed_tensors_schemes_fail_at_load_naming_what(
    quantization: dict, named: str, checkpoints: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Refused by the config alone: the checkpoint beside it is a plain one,
    so a refusal after reading weights would fail differently."""
    with pytest.raises(UnsupportedQuantization) as refusal:
        read_quantization(quantization)
    assert "compressed-tensors" in str(refusal.value)
    folder = with_quantization(checkpoints["qwen3-channel"][1], tmp_path / "quantised", quantization)
    with pytest.raises(ValueError, match=named):
        LLM(str(folder))


def test_llm_compressor_presets_parse() -> None:
    """The three FP8 presets as llm-compressor writes them (FP8: static
    per-tensor activations; FP8_DYNAMIC; FP8_BLOCK, with per-group activations)."""
    tensor = read_quantization(compressed_tensors_config("tensor", input_scales=True))
    assert tensor == Fp8Config(None, "static", "tensor", "compressed-tensors")
    assert read_quantization(compressed_tensors_config("channel")) == Fp8Config(None, "dynamic", "channel",
                                                                                "compressed-tensors")
    block = compressed_tensors_config("block")
    block["config_groups"]["group_0"]["input_activations"].update(strategy="group", group_size=128)
    assert read_quantization(block) == Fp8Config((128, 128), "dynamic", "block", "compressed-tensors")


def test_per_channel_weights_held_in_fp8_are_the_checkpoints_and_multiply_like_the_dequantised(
    checkpoints: dict[str, tuple[Path, Path]],
) -> None:
    """The CUDA path's layers (e4m3 weights, a float32 scale per row,
    torch._scaled_mm with row-wise scales), built on the CPU: the fused
    q/k/v and gate/up hold the checkpoint's bytes and each part's own
    per-channel scales in its rows; every layer multiplies within FP8's
    error of the dequantised one; the layer the `ignore` list left wide
    stays wide."""
    from aioserve.models.model_config import ModelConfig
    from aioserve.models.weight_loader import build_model

    fp8, _ = checkpoints["qwen3-channel"]
    config = ModelConfig.from_path(fp8)
    cpu = torch.device("cpu")
    held = build_model(config, fp8, torch.float32, cpu, "auto", 0, fp8_matmul="force")
    wide = build_model(config, fp8, torch.float32, cpu, "auto", 0, fp8_matmul="off")
    tensors = load_file(fp8 / "model.safetensors")
    for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                         ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")), ("mlp.down_proj", ("mlp.down_proj",))):
        layer = held.get_submodule(f"model.layers.0.{fused}")
        raw = torch.cat([tensors[f"model.layers.0.{p}.weight"] for p in parts])
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight.view(torch.uint8), raw.view(torch.uint8))
        scales = torch.cat([tensors[f"model.layers.0.{p}.weight_scale"] for p in parts])
        assert torch.equal(layer.weight_scale, scales.reshape(-1))
        assert len(set(scales.reshape(-1).tolist())) > 1  # per channel indeed
    ignored = "model.layers.1.mlp.down_proj"  # (CT_IGNORED): stays wide, as the checkpoint stores it
    assert torch.equal(held.get_submodule(ignored).weight, tensors[ignored + ".weight"])
    check_held_products(held, wide, left_wide=(ignored,))
    assert len(held_fp8_linears(held)) == 4 * config.num_layers - 1


@pytest.mark.gpu
def test_per_channel_fp8_matmuls_on_cuda(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    """On a GPU whose scaled matmul takes row-wise scales (Hopper on), the
    per-channel checkpoint's linear layers multiply in FP8 with their rows'
    own scales; prompt logprobs stay within FP8's error of the dequantised twin's."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled FP8 GEMMs need compute capability 9.0")
    fp8, reference = checkpoints["qwen3-channel"]
    assert cuda_logprob_gap(fp8, reference, hf_encode(reference, PROMPTS[4]), scale_dims=1, left_wide=1) < 0.1
