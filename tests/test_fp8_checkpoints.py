"""FP8 checkpoints (quantization_config fp8, e4m3 weights): written by the
tests with one scale per tensor and with 128 x 128 block scales (a dense
Qwen3 and a Qwen3-MoE whose experts are quantised too), they load
dequantised on the CPU and their greedy output equals transformers run on
the same weights dequantised, offline and over HTTP; a quantisation
aioserve cannot run fails at load naming the format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from aioserve import LLM, SamplingParams
from fp8_checkpoints import BLOCK, build_fp8_checkpoints, dequantize, quantize
from hf_reference import hf_encode, hf_greedy, hf_tokenizer
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
        assert llm.engine.model_config.fp8 is not None
        assert llm.engine.model_config.fp8.block == CASES[case][1]
        check_against_hf(reference, llm, [hf_encode(reference, p) for p in PROMPTS])
    finally:
        llm.close()


def test_fp8_over_http(fp8_checkpoints: dict[str, tuple[Path, Path]]) -> None:
    import openai
    from server_harness import start_server

    fp8, reference = fp8_checkpoints["qwen3-moe-block"]
    prompt = PROMPTS[1]
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
    folder = tmp_path / "quantised"
    shutil.copytree(reference, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
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
