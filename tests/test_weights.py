"""Loading: dtypes, dummy weights, incomplete checkpoints, Hugging Face ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aioserve import LLM, SamplingParams
from aioserve.cpu.dispatch import PERSONALITIES, choose_math_dtype
from aioserve.engine.dtypes import kv_cache_dtype, resolve_dtype
import aioserve.cpu_engine.fast_paths as fast_paths_module
import aioserve.engine.loading as loading_module
import aioserve.cpu.matmul as cpu_matmul_module
from aioserve.cpu.matmul import is_packed
from aioserve.models.model_config import ModelConfig
from aioserve.models.weight_loader import build_model


def test_dtype_resolution() -> None:
    assert resolve_dtype("auto", "bfloat16") == torch.bfloat16  # the checkpoint's, wherever it runs
    assert resolve_dtype("auto", None) == torch.float32
    assert resolve_dtype("bfloat16", "float32") == torch.bfloat16
    assert resolve_dtype("half", None) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", None)
    # The math's dtype is decided by what the CPU has, never assumed: try both kinds of machine.
    avx2, bf16_units = PERSONALITIES["avx2"], PERSONALITIES["avx512_bf16"]
    assert choose_math_dtype(avx2, torch.bfloat16)[0] == torch.float32  # emulated half: float32 math
    assert choose_math_dtype(avx2, torch.float16)[0] == torch.float32
    assert choose_math_dtype(bf16_units, torch.bfloat16)[0] == torch.bfloat16  # native bf16 units: keep it
    assert choose_math_dtype(bf16_units, torch.float16)[0] == torch.float32  # no fp16 units
    # The cache: as asked; under auto, the weights' width when a dtype was
    # asked for, the math's when that was auto too.
    assert kv_cache_dtype("auto", "auto", torch.bfloat16, torch.float32) == torch.float32
    assert kv_cache_dtype("auto", "bf16", torch.bfloat16, torch.float32) == torch.bfloat16
    assert kv_cache_dtype("auto", "auto", torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("float32", "bfloat16", torch.bfloat16, torch.bfloat16) == torch.float32


def bfloat16_copy(checkpoint: Path, folder: Path) -> Path:
    """The checkpoint with every tensor in bfloat16, as such checkpoints ship."""
    shutil.copytree(checkpoint, folder)
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"  # (transformers 5 writes "dtype")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_auto_keeps_a_half_checkpoint_half_where_the_math_is_float32(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without bf16 units, auto computes a bf16 checkpoint in
    float32 from bf16 weights (half the bytes a step) with a float32 cache:
    the same tokens and logprobs as loading it in float32."""
    path = bfloat16_copy(tiny_checkpoints["llama"], tmp_path / "bf16")
    monkeypatch.setattr(loading_module, "cpu_flags", lambda: PERSONALITIES["avx2"])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    prompt = "Once upon a time there was"
    auto = LLM(str(path), device="cpu", page_size=4)
    engine = auto.engine
    assert (engine.weight_dtype, engine.dtype, engine.kv_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    weight = engine.model.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == (torch.bfloat16 if is_packed(weight) else torch.float32)
    a = auto.generate(prompt, params)[0]
    auto.close()
    wide = LLM(str(path), dtype="float32", device="cpu", page_size=4)
    b = wide.generate(prompt, params)[0]
    wide.close()
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs


def test_matmul_weights_load_at_their_packed_width(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = bfloat16_copy(tiny_checkpoints["llama"], tmp_path / "bf16")
    config = ModelConfig.from_path(path)
    cpu = torch.device("cpu")
    model = build_model(config, path, torch.float32, cpu, "auto", 0, round_to=torch.bfloat16, matmul_dtype=torch.bfloat16)
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16  # no float32 copy
    assert layer.input_layernorm.weight.dtype == torch.float32  # the rest at the math's width
    full = load_file(path / "model.safetensors")
    assert torch.equal(layer.mlp.down_proj.weight, full["model.layers.0.mlp.down_proj.weight"])


def test_without_the_kernels_half_weights_are_widened_for_blas(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = bfloat16_copy(tiny_checkpoints["llama"], tmp_path / "bf16")
    building = lambda wait=True: None  # noqa: E731
    monkeypatch.setattr(cpu_matmul_module, "cpu_kernels", building)
    monkeypatch.setattr(loading_module, "cpu_kernels", building)
    monkeypatch.setattr(fast_paths_module, "cpu_kernels", building)
    llm = LLM(str(path), dtype="bfloat16", cpu_half_compute="float32", device="cpu", page_size=4)
    weight = llm.engine.model.model.layers[0].mlp.down_proj.weight
    assert not is_packed(weight) and weight.dtype == torch.float32
    assert len(llm.generate("hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids) == 4
    llm.close()


def test_half_compute_on_cpu() -> None:
    for flags in PERSONALITIES.values():
        assert choose_math_dtype(flags, torch.bfloat16, "native")[0] == torch.bfloat16
        assert choose_math_dtype(flags, torch.bfloat16, "float32")[0] == torch.float32
        assert choose_math_dtype(flags, torch.float32, "auto")[0] == torch.float32


@pytest.mark.parametrize("mode", ["native", "float32"])
def test_bfloat16_and_dummy_weights_generate(tiny_checkpoints: dict[str, Path], mode: str) -> None:
    path = tiny_checkpoints["qwen3"]
    llm = LLM(str(path), dtype="bfloat16", load_format="dummy", page_size=8, cpu_half_compute=mode, device="cpu")
    compute = torch.bfloat16 if mode == "native" else torch.float32
    assert llm.engine.pool.buffer.dtype == torch.bfloat16  # the cache keeps the weights' width
    weight = llm.engine.model.model.layers[0].mlp.down_proj.weight
    if is_packed(weight):  # the native matmul reads bf16 from memory whatever the math's width
        assert weight.dtype == torch.bfloat16
    else:
        assert weight.dtype == compute
        assert torch.equal(weight, weight.to(torch.bfloat16).to(compute))  # bfloat16 values either way
    out = llm.generate("hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    llm.close()


def test_kv_cache_dtype_option(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    wide = LLM(str(path), dtype="bfloat16", cpu_half_compute="float32", kv_cache_dtype="float32", device="cpu")
    narrow = LLM(str(path), dtype="bfloat16", cpu_half_compute="float32", device="cpu")
    assert wide.engine.pool.buffer.dtype == torch.float32
    assert narrow.engine.pool.buffer.dtype == torch.bfloat16
    # A bfloat16 cache halves the pool's bytes per token for the same budget.
    assert narrow.engine.pool.buffer.element_size() * 2 == wide.engine.pool.buffer.element_size()
    prompt = "Once upon a time there was"
    a, b = wide.generate(prompt, params)[0], narrow.generate(prompt, params)[0]
    assert len(a.token_ids) == len(b.token_ids) == 12
    # Rounding cached keys/values to bfloat16 moves logprobs by little.
    assert abs(a.logprobs[0] - b.logprobs[0]) < 0.05
    for llm in (wide, narrow):
        llm.close()


def test_float32_compute_of_bfloat16_weights_matches_native_greedy(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    native = LLM(str(path), dtype="bfloat16", cpu_half_compute="native", device="cpu")
    upcast = LLM(str(path), dtype="bfloat16", cpu_half_compute="float32", device="cpu")
    reference = LLM(str(path), dtype="float32", device="cpu")
    prompt = "Once upon a time there was"
    # Same weight values; float32 math sits closer to the float32 model.
    a = native.generate(prompt, params)[0].token_ids
    b = upcast.generate(prompt, params)[0].token_ids
    c = reference.generate(prompt, params)[0].token_ids
    assert len(a) == len(b) == 12
    assert sum(x == y for x, y in zip(b, c)) >= sum(x == y for x, y in zip(a, c))
    for llm in (native, upcast, reference):
        llm.close()


def test_missing_weight_is_reported(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["llama"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 weights.*layers\.1\.self_attn\.qkv_proj"):
        LLM(str(broken))


def test_unknown_architecture_and_unknown_model(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    odd = tmp_path / "odd"
    shutil.copytree(tiny_checkpoints["llama"], odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(odd))
    with pytest.raises(FileNotFoundError, match="neither a local folder"):
        LLM("no-such-org/no-such-model-xyz")
