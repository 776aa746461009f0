"""vLLM's and SGLang's launch flags: their quick-start lines for a Qwen3
model parse unchanged (the model path swapped) onto aioserve's own options,
and a flag whose feature aioserve lacks is a usage error that says why."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from aioserve.cli import parse_serve_args
from aioserve.config import DEMO_MODEL, EngineConfig, ServerArgs
from server_process import free_port

MODEL = "/models/qwen3"


def launch(line: str):
    """A vLLM or SGLang command line -> ServerArgs, its program and the
    model swapped for MODEL (everything else as the docs write it)."""
    words = shlex.split(line.replace("Qwen/Qwen3-0.6B", MODEL).replace("Qwen/Qwen3-8B", MODEL))
    if words[:2] == ["vllm", "serve"]:
        words = words[2:]
    elif words[:3] == ["python", "-m", "sglang.launch_server"]:
        words = words[3:]
    else:
        raise ValueError(line)
    return parse_serve_args(words)


def test_vllm_quick_start_lines() -> None:
    args = launch("vllm serve Qwen/Qwen3-0.6B --enable-reasoning --reasoning-parser deepseek_r1")
    assert (args.engine.model, args.reasoning_parser, args.enable_reasoning) == (MODEL, "deepseek_r1", True)
    args = launch("vllm serve Qwen/Qwen3-8B --reasoning-parser qwen3")
    assert (args.engine.model, args.reasoning_parser) == (MODEL, "qwen3")
    args = launch("vllm serve Qwen/Qwen3-8B --enable-auto-tool-choice --tool-call-parser hermes")
    assert (args.auto_tool_choice, args.tool_call_parser) == (True, "hermes")
    args = launch(
        "vllm serve Qwen/Qwen3-0.6B --max-model-len 32768 --max-num-seqs 16 --max-num-batched-tokens 2048 "
        "--no-enable-prefix-caching --enforce-eager --gpu-memory-utilization 0.8 --tensor-parallel-size 1 "
        "--generation-config auto --served-model-name qwen --host 0.0.0.0 --port 8001"
    )
    engine = args.engine
    assert (engine.max_model_len, engine.max_running_requests, engine.max_prefill_tokens) == (32768, 16, 2048)
    assert (engine.cache, engine.cuda_graph, engine.mem_fraction_static, engine.tp_size) == ("naive", False, 0.8, 1)
    assert (args.generation_config, args.model_name, args.host, args.port) == ("auto", "qwen", "0.0.0.0", 8001)
    assert launch("vllm serve Qwen/Qwen3-8B --enable-prefix-caching").engine.cache == "radix"
    assert launch("vllm serve Qwen/Qwen3-8B --generation-config vllm").generation_config == "vllm"


def test_sglang_quick_start_lines() -> None:
    args = launch("python -m sglang.launch_server --model-path Qwen/Qwen3-8B --reasoning-parser qwen3")
    assert (args.engine.model, args.reasoning_parser) == (MODEL, "qwen3")
    args = launch(
        "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --tool-call-parser qwen25 "
        "--context-length 32768 --reasoning-parser qwen3 --port 30000"
    )
    assert (args.tool_call_parser, args.engine.max_model_len, args.port) == ("qwen25", 32768, 30000)
    args = launch(
        "python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --chunked-prefill-size 4096 "
        "--disable-radix-cache --disable-cuda-graph --max-running-requests 8 --mem-fraction-static 0.7 --tp 1"
    )
    engine = args.engine
    assert (engine.max_prefill_tokens, engine.cache, engine.cuda_graph) == (4096, "naive", False)
    assert (engine.max_running_requests, engine.mem_fraction_static, engine.tp_size) == (8, 0.7, 1)


def test_positional_model() -> None:
    assert parse_serve_args([MODEL]).engine.model == MODEL
    assert parse_serve_args(["--port", "9", MODEL, "--max-num-seqs", "4"]).engine.max_running_requests == 4
    assert parse_serve_args(["--model", MODEL, MODEL]).engine.model == MODEL  # the same name twice is fine
    assert parse_serve_args([]).engine.model == DEMO_MODEL
    # The switches leave the option's default alone when absent.
    assert parse_serve_args([MODEL]) == ServerArgs(engine=EngineConfig(model=MODEL))


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_two_different_models_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "the model is named twice" in usage_error(["a", "--model", "b"], capsys)


def test_trust_remote_code_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error([MODEL, "--trust-remote-code"], capsys)
    assert "--trust-remote-code is not supported" in err and "never runs Python code shipped with a model" in err
    from aioserve.models.registry import MODEL_CLASSES

    assert all(name.removesuffix("ForCausalLM") in err for name in MODEL_CLASSES)  # every family served, no fewer


def test_enable_reasoning_needs_a_parser(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--enable-reasoning needs --reasoning-parser" in usage_error([MODEL, "--enable-reasoning"], capsys)


def test_ssl_files_go_together(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_serve_args([MODEL, "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"])
    assert (args.ssl_keyfile, args.ssl_certfile) == ("k.pem", "c.pem")
    assert "go together" in usage_error([MODEL, "--ssl-certfile", "c.pem"], capsys)


def test_unknown_parser_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error([MODEL, "--reasoning-parser", "nope"], capsys)
    assert "invalid choice" in err and "qwen3" in err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_ssl_files_serve_https(stories_path: Path, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "aioserve", "serve", str(stories_path), "--port", str(port),
         "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            try:
                models = httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=str(cert), timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.3)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == str(stories_path)
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_default_chat_template_kwargs_and_new_tool_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    args = launch("vllm serve Qwen/Qwen3-8B --default-chat-template-kwargs '{\"enable_thinking\": false}'")
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    for parser in ("mistral", "pythonic", "llama4_pythonic", "qwen3_coder"):
        assert launch(f"vllm serve Qwen/Qwen3-8B --enable-auto-tool-choice --tool-call-parser {parser}").tool_call_parser == parser
    with pytest.raises(SystemExit):
        launch("vllm serve Qwen/Qwen3-8B --default-chat-template-kwargs '[1]'")
    assert "must be a JSON object" in capsys.readouterr().err
