"""The model's generation_config.json sampling fields are the defaults of a
request's unset fields (--generation-config auto, vLLM's default), and a
field the request sets wins. Proven by seeded sampling: a request that
leaves temperature unset draws exactly what one that spells out 0.6 draws.

The server is started with vLLM's launch flags (positional model, its
reasoning and tool switches), so it also proves that such a line serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from aioserve.server.errors import APIError
from aioserve.server.intake.generation_defaults import load_generation_defaults
from aioserve.server.intake.openai_requests import ChatCompletionRequest
from aioserve.server.output.tools import plan_tools

QWEN3_STYLE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": 2, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def qwen3_style_model(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(llama_path, folder)
    (folder / "generation_config.json").write_text(json.dumps(QWEN3_STYLE))
    return folder


@pytest.fixture(scope="module")
def server(qwen3_style_model: Path):
    from server_harness import start_server

    # vLLM's quick-start spelling, model positional (ServerProcess also passes --model: the same name).
    server = start_server(
        qwen3_style_model, str(qwen3_style_model), "--enable-reasoning", "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64", "--enable-prefix-caching", "--page-size", "4",
    )
    yield server
    server.stop()


def complete(server, **fields) -> str:
    body = {"prompt": "Once upon a time", "max_tokens": 24, "seed": 7, "ignore_eos": True, **fields}
    response = httpx.post(f"{server.v1}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_server_info_shows_the_defaults(server) -> None:
    assert server.info()["generation_defaults"] == DEFAULTS


def test_unset_fields_take_the_models_defaults(server) -> None:
    unset = complete(server)
    assert unset == complete(server, **DEFAULTS)
    assert unset == complete(server, temperature=None)  # an explicit null is unset too
    # A neutral request draws differently: the defaults did change the sampling.
    assert unset != complete(server, temperature=1.0, top_p=1.0, top_k=-1)


def test_a_set_field_wins(server) -> None:
    hot = complete(server, temperature=1.0)
    assert hot == complete(server, temperature=1.0, top_p=0.95, top_k=20)  # the others still default
    assert hot != complete(server)


def test_sglang_generate_takes_them_too(server) -> None:
    def generate(sampling: dict) -> str:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 24, "sampling_seed": 7,
                                                                "ignore_eos": True, **sampling}}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["text"]

    assert generate({}) == generate(DEFAULTS) != generate({"temperature": 1.0, "top_p": 1.0, "top_k": -1})


def test_the_vllm_switches_serve_tools_and_reasoning(server) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
    }
    response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def test_generation_config_options(qwen3_style_model: Path, tmp_path: Path) -> None:
    assert load_generation_defaults("auto", qwen3_style_model) == DEFAULTS
    assert load_generation_defaults("vllm", qwen3_style_model) == {}
    assert load_generation_defaults("none", qwen3_style_model) == {}
    assert load_generation_defaults(str(qwen3_style_model), tmp_path) == DEFAULTS  # a folder of its own
    assert load_generation_defaults("auto", tmp_path) == {}  # a model without the file
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path), qwen3_style_model)


def test_auto_tool_choice_can_be_turned_off() -> None:
    ctx = SimpleNamespace(args=SimpleNamespace(auto_tool_choice=False))
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    with pytest.raises(APIError, match="--disable-auto-tool-choice") as error:
        plan_tools(ctx, body)  # type: ignore[arg-type]
    assert error.value.param == "tool_choice"
