"""Tiny checkpoints in the FP8 layout, written by the tests: each linear
weight quantised to e4m3 with one scale per tensor (`weight_scale`) or per
128 x 128 block (`weight_scale_inv`, as the published Qwen3-FP8 checkpoints
name it), or in compressed-tensors' layout (llm-compressor's output: per
tensor, per channel or per block `weight_scale`, an `ignore` list), the
config's quantization_config saying so; and beside it the
same model with those weights dequantised in float32 (what transformers
runs as the oracle)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_models import build_checkpoint

E4M3_MAX = 448.0
BLOCK = (128, 128)
# The projections FP8 checkpoints quantise (embeddings, norms, the router and the LM head stay wide).
QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(
    weight: torch.Tensor, block: tuple[int, int] | None, per_channel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale): one scale, one per row ([N, 1]), or one
    per block (edge blocks partial)."""
    if per_channel:
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale.float()
    if block is None:
        scale = weight.abs().max().clamp(min=1e-12) / E4M3_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(()).float()
    rows, cols = weight.shape
    br, bc = block
    grid = (-(-rows // br), -(-cols // bc))
    padded = torch.zeros(grid[0] * br, grid[1] * bc)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(grid[0], br, grid[1], bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    expanded = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight / expanded).to(torch.float8_e4m3fn), scale.float()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        return q.float() * scale  # (a [N, 1] per-channel scale broadcasts over its rows)
    rows, cols = q.shape
    return q.float() * scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def build_fp8_checkpoints(
    name: str, root: Path, block: tuple[int, int] | None, overrides: dict | None = None
) -> tuple[Path, Path]:
    """(the FP8 checkpoint, its dequantised float32 twin) of tiny model `name`."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              **({"weight_block_size": list(block)} if block else {})}
    return _write_checkpoints(name, root, overrides, config, block, "_scale_inv" if block else "_scale")


# Layers llm-compressor's recipes leave wide besides the LM head: here one
# MLP's down projection (by regex, as recipes name them).
CT_IGNORED = "re:.*layers[.]1[.]mlp[.]down_proj$"


def compressed_tensors_config(strategy: str, input_scales: bool = False) -> dict:
    """The quantization_config llm-compressor writes for its FP8 (static
    per-tensor activations), FP8_DYNAMIC (per-channel weights, per-token
    activations) and FP8_BLOCK schemes, with weights of `strategy`."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": list(BLOCK) if strategy == "block" else None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
                   "actorder": None, "observer": None, "observer_kwargs": {},
                   **({"dynamic": False, "strategy": "tensor", "observer": "minmax"} if input_scales
                      else {"dynamic": True, "strategy": "token"})}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                      "output_activations": None, "format": "float-quantized"}},
        "ignore": ["lm_head", CT_IGNORED], "global_compression_ratio": None,
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                            "symmetric": True} if input_scales else None,
        "sparsity_config": {}, "transform_config": {}, "version": "0.12.2",
    }


def build_compressed_tensors_checkpoints(
    name: str, root: Path, strategy: str, overrides: dict | None = None, input_scales: bool = False
) -> tuple[Path, Path]:
    """(a compressed-tensors FP8 checkpoint with weights of `strategy`, its
    dequantised float32 twin) of tiny model `name`: scales `weight_scale`
    ([1] per tensor, [N, 1] per channel, [N/128, K/128] per block), the
    layers of `ignore` left wide; with `input_scales`, static `input_scale`s
    beside the weights and a kv_cache_scheme's KV scales (`self_attn.k_scale`,
    and the older `v_proj.output_scale`)."""
    config = compressed_tensors_config(strategy, input_scales)
    return _write_checkpoints(name, root, overrides, config, BLOCK if strategy == "block" else None, "_scale",
                              per_channel=strategy == "channel", input_scales=input_scales,
                              ignored=CT_IGNORED.removeprefix("re:"))


def _write_checkpoints(
    name: str, root: Path, overrides: dict | None, quantization: dict, block: tuple[int, int] | None,
    scale_suffix: str, per_channel: bool = False, input_scales: bool = False, ignored: str | None = None,
) -> tuple[Path, Path]:
    source = build_checkpoint(name, root / "source", overrides=overrides)
    fp8, reference = root / "fp8", root / "dequantised"
    for folder in (fp8, reference):
        shutil.copytree(source, folder)
        for file in folder.glob("*.safetensors"):
            file.unlink()
    quantised: dict[str, torch.Tensor] = {}
    wide: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        for key, tensor in load_file(file).items():
            module = key.removesuffix(".weight").rsplit(".", 1)[-1]
            left_wide = ignored is not None and re.fullmatch(ignored, key.removesuffix(".weight"))
            if key.endswith(".weight") and module in QUANTISED and tensor.dim() == 2 and not left_wide:
                q, scale = quantize(tensor, block, per_channel)
                quantised[key] = q
                # (compressed-tensors writes a per-tensor scale as [1], the fp8 method's as [])
                quantised[key + scale_suffix] = scale.reshape(1) if scale.dim() == 0 and ignored is not None else scale
                if input_scales:  # a calibrated static activation scale (aioserve quantises per token instead)
                    quantised[key.removesuffix("weight") + "input_scale"] = torch.tensor([0.01])
                if input_scales and module == "k_proj":  # and a kv_cache_scheme's KV scales, in both places
                    attention = key.removesuffix("k_proj.weight")
                    quantised[attention + "k_scale"] = torch.tensor(0.1)
                    quantised[attention + "v_proj.output_scale"] = torch.tensor(0.1)
                wide[key] = dequantize(q, scale, block)
            else:
                quantised[key] = wide[key] = tensor
    save_file(quantised, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(wide, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = quantization
    (fp8 / "config.json").write_text(json.dumps(config, indent=2))
    return fp8, reference


REAL_SCALED_MM = torch.nn.functional.scaled_mm  # before any test stands the reference in for it


def reference_scaled_mm(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_recipe_a: object,
    scale_b: torch.Tensor, scale_recipe_b: object, *args: object, output_dtype: torch.dtype | None = torch.bfloat16,
    **kwargs: object,
) -> torch.Tensor:
    """torch.nn.functional.scaled_mm's 1x128 x 128x128 recipe on the CPU,
    written from its meaning: out[m, n] = sum_k a[m, k] * sa[m, k // 128] *
    b[k, n] * sb[k // 128, n // 128], in float64. First torch's own checks
    of the operands' shapes, strides and dtypes run on meta copies of them
    (the checks a CUDA call makes), so a layout the GPU would refuse fails here."""
    F = torch.nn.functional
    assert (scale_recipe_a, scale_recipe_b) == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
    assert not args and not kwargs, "the block-scaled path passes no swizzle, bias or accumulation options"
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for t in (mat_a, mat_b, scale_a, scale_b)]
    REAL_SCALED_MM(meta[0], meta[1], meta[2], scale_recipe_a, meta[3], scale_recipe_b, output_dtype=output_dtype)
    # What torch's checks miss: cuBLASLt's heuristic refuses M not a multiple
    # of 4 (CUBLAS_STATUS_NOT_SUPPORTED on an H100, torch 2.11 + CUDA 13.0,
    # for every K and N tried), raised here as the GPU raises it.
    if mat_a.shape[0] % 4:
        raise RuntimeError(f"CUDA error: CUBLAS_STATUS_NOT_SUPPORTED (block-scaled FP8 with M = {mat_a.shape[0]}, "
                           "not a multiple of 4)")
    k, n = mat_b.shape
    ks, ns = torch.arange(k), torch.arange(n)
    a = mat_a.double() * scale_a.double()[:, ks // 128]
    b = mat_b.double() * scale_b.double()[ks // 128][:, ns // 128]
    return (a @ b).to(output_dtype or torch.bfloat16)


def fake_quantise_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the block-scaled FP8 GEMM sees it: each token's 128-column groups
    scaled so their largest magnitude is e4m3's largest, rounded to e4m3, scaled back."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape).to(x.dtype)


def held_fp8_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's linear layers that hold their weights in FP8."""
    from aioserve.layers.linear import ColumnParallelLinear, RowParallelLinear

    return {name: m for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight_scale is not None}


def cuda_logprob_gap(fp8: Path, reference: Path, prompt: list[int], scale_dims: int, left_wide: int = 0) -> float:
    """An FP8 checkpoint and its dequantised twin served in bfloat16 on CUDA:
    every linear layer of the first holds FP8 (scales of `scale_dims` dims:
    1 per row, 2 per block) but the `left_wide` the checkpoint stores
    unquantised, none of the second's; 8 greedy tokens decode
    (CUDA graphs included). Returns the mean gap of their prompt logprobs."""
    from aioserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    results = []
    for path in (fp8, reference):
        llm = LLM(str(path), page_size=16, dtype="bfloat16")
        try:
            held = held_fp8_linears(llm.engine.model)
            assert len(held) == (4 * llm.engine.model_config.num_layers - left_wide if path == fp8 else 0)
            assert all(m.weight_scale.dim() == scale_dims for m in held.values())
            out = llm.generate([prompt], params)[0]
            results.append([entry[0] for entry in out.prompt_logprobs if entry is not None])
            assert len(out.token_ids) == 8
        finally:
            llm.close()
    got, expected = (torch.tensor(r) for r in results)
    return (got - expected).abs().mean().item()


def with_quantization(checkpoint: Path, folder: Path, quantization: dict) -> Path:
    """A copy of `checkpoint` in `folder` whose config.json says `quantization`."""
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def check_completion_over_http(fp8: Path, reference: Path, prompt: str) -> None:
    """The FP8 checkpoint served over HTTP: 10 greedy tokens of `prompt`
    decode to the text transformers gives on the dequantised twin."""
    import openai

    from hf_reference import hf_encode, hf_greedy, hf_tokenizer
    from server_harness import start_server

    expected, _ = hf_greedy(reference, hf_encode(reference, prompt), 10)
    server = start_server(fp8, "--page-size", "4")
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        out = client.completions.create(
            model=server.info()["model"], prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == 10
        # The text, but for a trailing partial UTF-8 character the server holds back.
        text = hf_tokenizer(str(reference)).decode(expected)
        assert text.startswith(out.choices[0].text) and len(out.choices[0].text) >= len(text.rstrip("\ufffd"))
    finally:
        server.stop()


def check_held_products(held: torch.nn.Module, wide: torch.nn.Module, left_wide: tuple[str, ...] = ()) -> None:
    """Every linear layer of `held` (built with fp8_matmul "force") holds
    e4m3 weights, but those named in `left_wide`, and multiplies within
    FP8's error of the same layer of `wide` (fp8_matmul "off": dequantised)."""
    from aioserve.layers.linear import ColumnParallelLinear, RowParallelLinear

    def linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return {n: m for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}

    torch.manual_seed(0)
    layers, references = linears(held), linears(wide)
    assert layers.keys() == references.keys() and layers
    for name, layer in layers.items():
        assert layer.weight.dtype == (torch.float32 if name in left_wide else torch.float8_e4m3fn), name
        reference = references[name]
        assert reference.weight_scale is None and reference.weight.dtype == torch.float32
        inputs = torch.randn(5, reference.weight.shape[1])
        expected = torch.nn.functional.linear(inputs, reference.weight)
        error = (layer(inputs) - expected).abs().max() / expected.abs().max()
        assert error < 0.08, f"{name}: {error}"
