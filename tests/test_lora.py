"""Multi-LoRA serving against PEFT itself: tiny random bases, adapters
written by `peft` (ranks 4-16, different targets, rsLoRA, a rank_pattern),
greedy tokens and logprobs equal PEFT's in float32 for each adapter alone
and for batches that mix four adapters with the base; chunked prefill,
prefix hits and preemption change nothing; the prefix cache never shares
KV between adapters; and the routes and fields vLLM and SGLang users send
(model, lora_path, load/unload) work through HTTP and the openai client."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from lora_adapters import AdapterSpec, base_model, peft_greedy, write_adapter
from server_harness import start_server
from tiny_models import build_checkpoint

from aioserve import LLM, SamplingParams
from aioserve.cpu.native import cpu_kernels
from aioserve.cpu_engine.decode_stack import NativeDecodeRunner

pytest.importorskip("peft")

ADAPTERS: dict[str, AdapterSpec] = {
    "full": AdapterSpec(rank=8, seed=1),
    "q-rslora": AdapterSpec(rank=4, targets=("q_proj",), use_rslora=True, seed=2),
    "mlp": AdapterSpec(rank=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj"), seed=3),
    "pattern": AdapterSpec(rank=8, targets=("q_proj", "v_proj", "o_proj"), rank_pattern={"v_proj": 4}, seed=4),
}
PROMPTS = [
    [5, 17, 33, 81, 9, 100, 42, 7],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
    [200, 3, 150, 77, 64],
]
MAX_TOKENS = 10
LONG = 400  # tokens of a request that must still run when its adapter is unloaded
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    checkpoint = build_checkpoint("llama", root / "llama")
    folders = {name: write_adapter(checkpoint, root / name, spec) for name, spec in ADAPTERS.items()}
    reference = {
        (name, i): peft_greedy(checkpoint, folders.get(name), prompt, MAX_TOKENS)
        for name in [None, *ADAPTERS] for i, prompt in enumerate(PROMPTS)
    }
    return {"root": root, "checkpoint": checkpoint, "folders": folders, "reference": reference}


def _modules(setup: dict[str, Any]) -> list[str]:
    return [f"{name}={folder}" for name, folder in setup["folders"].items()]


def _mixed_batch() -> tuple[list[list[int]], list[str | None]]:
    """Every prompt under every adapter and the base, interleaved."""
    prompts, choices = [], []
    for i, prompt in enumerate(PROMPTS):
        for name in [None, *ADAPTERS]:
            prompts.append(prompt)
            choices.append(name)
    return prompts, choices


def _expected(setup: dict[str, Any], prompts: list[list[int]], choices: list[str | None]) -> list[list[int]]:
    return [setup["reference"][(name, PROMPTS.index(prompt))] for prompt, name in zip(prompts, choices)]


@pytest.mark.parametrize("options", [
    {},  # every request at once: the masked form for decodes, grouped prefill
    {"max_prefill_tokens": 8, "max_loras": 2},  # chunked prompts; more adapters than slots: they take turns
    {"num_pages": 12, "page_size": 4, "max_running_requests": 6},  # a small pool: preemption
    {"max_loras": 1, "max_cpu_loras": 1},  # one slot, one adapter in host memory: the others read again
], ids=["together", "chunked-2-slots", "preempted", "one-slot"])
def test_mixed_batches_equal_peft(setup: dict[str, Any], options: dict[str, Any]) -> None:
    llm = LLM(str(setup["checkpoint"]), dtype="float32", enable_lora=True, lora_modules=_modules(setup),
              debug_integrity=True, **options)
    try:
        prompts, choices = _mixed_batch()
        outputs = llm.generate(prompts, GREEDY, lora_request=choices)
        assert [o.token_ids for o in outputs] == _expected(setup, prompts, choices)
        runner = llm.engine.graph_runner
        if cpu_kernels() is not None and not options:  # the native decode step ran the adapters
            assert isinstance(runner, NativeDecodeRunner) and runner.lora_bound and runner.replays > 0
        if "num_pages" in options:
            assert llm.stats.preemptions > 0
        if "max_loras" in options:
            assert llm.scheduler.adapters is not None and llm.scheduler.adapters.evictions > 0
        if "max_cpu_loras" in options:
            assert llm.engine.lora is not None and llm.engine.lora.reads > len(ADAPTERS)
        llm.scheduler.check_integrity()
    finally:
        llm.close()


def test_logprobs_equal_peft_merged_and_unmerged(setup: dict[str, Any]) -> None:
    from peft import PeftModel

    checkpoint, folder = setup["checkpoint"], setup["folders"]["full"]
    llm = LLM(str(checkpoint), dtype="float32", enable_lora=True, lora_modules=[f"full={folder}"])
    try:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                         logprobs=0), lora_request="full")[0]
    finally:
        llm.close()
    ids = torch.tensor([PROMPTS[0] + out.token_ids])
    unmerged = PeftModel.from_pretrained(base_model(checkpoint), folder).eval()
    merged = PeftModel.from_pretrained(base_model(checkpoint), folder).merge_and_unload().eval()
    for model in (unmerged, merged):
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPTS[0]) - 1 : -1].log_softmax(-1)
        expected = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_prefix_cache_is_keyed_by_adapter(setup: dict[str, Any]) -> None:
    llm = LLM(str(setup["checkpoint"]), dtype="float32", enable_lora=True, lora_modules=_modules(setup), page_size=4)
    prompt = PROMPTS[1]
    try:
        first = llm.generate([prompt], GREEDY, lora_request="full")[0]
        other = llm.generate([prompt], GREEDY, lora_request="mlp")[0]
        base = llm.generate([prompt], GREEDY)[0]
        again = llm.generate([prompt], GREEDY, lora_request="full")[0]
    finally:
        llm.close()
    assert first.num_cached_tokens == other.num_cached_tokens == base.num_cached_tokens == 0
    assert again.num_cached_tokens == 20  # the same adapter finds its pages
    assert again.token_ids == first.token_ids == setup["reference"][("full", 1)]
    assert other.token_ids == setup["reference"][("mlp", 1)] and base.token_ids == setup["reference"][(None, 1)]


def test_tensor_parallel_equals_one_rank(setup: dict[str, Any]) -> None:
    llm = LLM(str(setup["checkpoint"]), dtype="float32", enable_lora=True, lora_modules=_modules(setup), tp=2)
    try:
        prompts, choices = _mixed_batch()
        outputs = llm.generate(prompts, GREEDY, lora_request=choices)
    finally:
        llm.close()
    assert [o.token_ids for o in outputs] == _expected(setup, prompts, choices)


@pytest.mark.parametrize(("config", "weights", "message"), [
    ({"use_dora": True}, None, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"r": 32}, "rank32", "--max-lora-rank"),
    (None, "missing", "no adapter_model.safetensors"),
    (None, "garbage", "not a readable safetensors"),
], ids=["dora", "modules-to-save", "rank", "no-weights", "garbage"])
def test_adapters_that_cannot_be_served_are_refused(setup: dict[str, Any], tmp_path: Path, config: dict | None,
                                                    weights: str | None, message: str) -> None:
    from aioserve.lora.peft_folder import read_peft_adapter
    from aioserve.lora_config import AdapterError

    folder = tmp_path / "adapter"
    if weights == "rank32":
        write_adapter(setup["checkpoint"], folder, AdapterSpec(rank=32, targets=("q_proj",)))
    else:
        shutil.copytree(setup["folders"]["q-rslora"], folder)
    if config:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if weights == "missing":
        (folder / "adapter_model.safetensors").unlink()
    elif weights == "garbage":
        (folder / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(AdapterError, match=message):
        read_peft_adapter(folder, max_rank=16)


def test_an_adapter_of_another_base_is_refused(setup: dict[str, Any], tmp_path: Path) -> None:
    other = build_checkpoint("llama", tmp_path / "wider", overrides={"hidden_size": 96})
    folder = write_adapter(other, tmp_path / "wider-adapter", AdapterSpec(rank=4, targets=("q_proj",)))
    llm = LLM(str(setup["checkpoint"]), dtype="float32", enable_lora=True)
    try:
        from aioserve.lora_config import AdapterError

        with pytest.raises(AdapterError, match="another base model"):
            llm.load_lora_adapter("wider", str(folder))
        assert llm.scheduler.adapter("wider") is None
    finally:
        llm.close()


# -- HTTP ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(setup: dict[str, Any]):
    folders = setup["folders"]
    running = start_server(
        setup["checkpoint"], "--dtype", "float32", "--enable-lora", "--lora-modules",
        f"full={folders['full']}", f"q-rslora={folders['q-rslora']}", "--max-loras", "2", "--debug-integrity",
    )
    yield running
    running.stop()


def _served(server: Any) -> str:
    return httpx.get(f"{server.v1}/models", timeout=30).json()["data"][0]["id"]


def test_openai_client_selects_adapters_by_model(server: Any, setup: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="none")
    models = {m.id: m for m in client.models.list().data}
    base = _served(server)
    assert set(models) == {base, "full", "q-rslora"}
    assert models["full"].model_extra["parent"] == base and models[base].model_extra["parent"] is None
    lora = httpx.get(f"{server.url}/server_info", timeout=10).json()["lora"]
    assert (lora["max_loras"], lora["max_lora_rank"], lora["max_cpu_loras"]) == (2, 16, None)
    assert set(lora["adapters"]) == {"full", "q-rslora"}
    for name in (base, "full", "q-rslora"):
        out = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        generated = _generate(server, PROMPTS[0], name, MAX_TOKENS)
        assert generated["output_ids"] == setup["reference"][(None if name == base else name, 0)]
        assert out.choices[0].text == generated["text"]


def _generate(server: Any, prompt: list[int], lora_path: str | None, max_tokens: int) -> dict[str, Any]:
    """SGLang's /generate (its output ids, to compare with PEFT's tokens)."""
    body = {"input_ids": prompt, "lora_path": lora_path,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_load_use_and_unload_through_the_routes(server: Any, setup: dict[str, Any]) -> None:
    folder = str(setup["folders"]["mlp"])
    loaded = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "mlp", "lora_path": folder}, timeout=60)
    assert loaded.status_code == 200 and "mlp" in loaded.text
    again = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "mlp", "lora_path": folder}, timeout=60)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert _generate(server, PROMPTS[2], "mlp", MAX_TOKENS)["output_ids"] == setup["reference"][("mlp", 2)]
    body = {"input_ids": PROMPTS[2], "lora_path": "mlp", "sampling_params": {"max_new_tokens": 2}}
    # SGLang's pair answers in its JSON.
    unloaded = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=30).json()
    assert unloaded["success"] and "mlp" not in unloaded["loaded_adapters"]
    gone = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_path"
    missing = httpx.post(f"{server.v1}/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=30)
    assert missing.status_code == 404
    server.wait_idle()


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "no-such-adapter"}, 404, "model"),
], ids=["unknown-model"])
def test_unknown_adapter_is_a_404(server: Any, body: dict, status: int, param: str) -> None:
    response = httpx.post(f"{server.v1}/completions", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param and error["code"] == "model_not_found"


def test_malformed_and_oversized_adapters_are_400s(server: Any, setup: dict[str, Any], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    big = write_adapter(setup["checkpoint"], tmp_path / "big", AdapterSpec(rank=32, targets=("q_proj",)))
    for name, path, words in (("broken", broken, "not readable JSON"), ("big", big, "--max-lora-rank"),
                              ("nowhere", tmp_path / "nowhere", "no adapter_config.json")):
        response = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                              timeout=60)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    assert {m["id"] for m in httpx.get(f"{server.v1}/models", timeout=30).json()["data"]} == {
        _served(server), "full", "q-rslora"}
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_unloading_an_adapter_in_use_loses_nothing(server: Any, setup: dict[str, Any]) -> None:
    folder = str(setup["folders"]["pattern"])
    assert httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "pattern", "lora_path": folder},
                      timeout=60).status_code == 200
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        # Long enough that the unload lands while it runs.
        results[name] = _generate(server, PROMPTS[1], name, LONG)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("pattern", "full")]
    for thread in threads:
        thread.start()
    # Once its request runs, take the name away: the request finishes on it.
    deadline = 200
    while httpx.get(f"{server.url}/server_info", timeout=10).json()["running"] < 2 and deadline:
        deadline -= 1
    assert httpx.post(f"{server.v1}/unload_lora_adapter", json={"lora_name": "pattern"}, timeout=30).status_code == 200
    assert threads[0].is_alive(), "the unload was meant to land while the adapter's request ran"
    for thread in threads:
        thread.join()
    for name in ("pattern", "full"):
        output_ids = results[name]["output_ids"]
        assert len(output_ids) == LONG and output_ids[:MAX_TOKENS] == setup["reference"][(name, 1)]
    after = httpx.post(f"{server.v1}/completions", json={"model": "pattern", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert after.status_code == 404
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "aioserve:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
    assert "aioserve:lora_slot_evictions_total" in metrics
    server.wait_idle()


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(("family", "targets"), [
    ("qwen3-moe", ATTENTION),  # an MoE family's attention
    ("mixtral", ATTENTION),
    ("gemma3", ADAPTERS["full"].targets),
])
def test_other_families_equal_peft(tmp_path: Path, family: str, targets: tuple[str, ...]) -> None:
    checkpoint = build_checkpoint(family, tmp_path / family)
    folder = write_adapter(checkpoint, tmp_path / "adapter", AdapterSpec(rank=8, targets=targets, seed=5))
    expected = [peft_greedy(checkpoint, adapter, PROMPTS[0], MAX_TOKENS) for adapter in (folder, None)]
    llm = LLM(str(checkpoint), dtype="float32", enable_lora=True, lora_modules=[f"a={folder}"])
    try:
        outputs = llm.generate([PROMPTS[0]] * 2, GREEDY, lora_request=["a", None])
    finally:
        llm.close()
    assert [o.token_ids for o in outputs] == expected
    assert expected[0] != expected[1]  # the adapter changes the output


def test_an_adapter_of_moe_experts_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from aioserve.lora_config import AdapterError

    checkpoint = build_checkpoint("qwen3-moe", tmp_path / "moe")
    folder = tmp_path / "experts-adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    name = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file({f"{name}.lora_A.weight": torch.zeros(4, 64), f"{name}.lora_B.weight": torch.zeros(32, 4)},
              str(folder / "adapter_model.safetensors"))
    llm = LLM(str(checkpoint), dtype="float32", enable_lora=True)
    try:
        with pytest.raises(AdapterError, match="MoE experts"):
            llm.load_lora_adapter("experts", str(folder))
    finally:
        llm.close()


def test_a_failed_slot_load_fails_its_requests_and_loads_again(setup: dict[str, Any], tmp_path: Path) -> None:
    """An adapter whose folder went away while it was out of host memory:
    the step that loads it fails its requests (not the server), and once the
    folder is back the next request loads it and runs right."""
    folder = shutil.copytree(setup["folders"]["full"], tmp_path / "full")
    llm = LLM(str(setup["checkpoint"]), dtype="float32", enable_lora=True, lora_modules=[f"full={folder}"],
              debug_integrity=True)
    try:
        assert llm.engine.lora is not None
        llm.engine.lora.forget(llm.scheduler.adapter("full").id)  # out of host memory: read again when next used
        hidden = folder.rename(tmp_path / "moved")
        failed = llm.generate([PROMPTS[0]], GREEDY, lora_request="full")[0]
        assert failed.finish_reason == "error"
        hidden.rename(folder)
        again = llm.generate([PROMPTS[0]], GREEDY, lora_request="full")[0]
        assert again.token_ids == setup["reference"][("full", 0)]
        llm.scheduler.check_integrity()
    finally:
        llm.close()


def test_captured_decode_steps_run_adapters(setup: dict[str, Any]) -> None:
    """The CUDA graph runner's LoRA graphs on CPU (EagerCapture replays the
    captured step over the runner's buffers): a mixed batch's decode steps
    replay them, with the one-hot slots written in place each step."""
    from aioserve.engine.cuda_graph import EagerCapture

    llm = LLM(str(setup["checkpoint"]), dtype="float32", enable_lora=True, lora_modules=_modules(setup),
              cuda_graph=False, max_running_requests=16, cuda_graph_max_bs=16)
    try:
        runner = llm.engine.graph_runner = llm.engine.capture_decode_graphs(EagerCapture())
        prompts, choices = _mixed_batch()
        outputs = llm.generate(prompts, GREEDY, lora_request=choices)
        assert [o.token_ids for o in outputs] == _expected(setup, prompts, choices)
        assert runner.replays > 0 and runner.lora_steps
    finally:
        llm.close()


def test_the_flags_of_vllm_and_sglang_parse_and_round_trip() -> None:
    from aioserve.cli import parse_serve_args, serve_argv
    from aioserve.config import ConfigError
    from aioserve.lora_config import parse_adapter_source, resolve_lora

    args = parse_serve_args(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--lora-paths", "/z",
                             "--max-loras-per-batch", "3", "--max-lora-rank", "32"])
    lora = resolve_lora(args.engine)
    assert lora is not None and (lora.max_loras, lora.max_lora_rank) == (3, 32)
    assert [(s.name, s.path) for s in lora.adapters] == [("a", "/x"), ("b", "/y"), ("/z", "/z")]
    assert parse_serve_args(serve_argv(args)).engine == args.engine  # what --dp starts its replicas with
    typed = parse_serve_args(["--enable-lora", "--lora-dtype", "bfloat16"])
    assert parse_serve_args(serve_argv(typed)).engine == typed.engine
    assert resolve_lora(typed.engine).dtype == "bfloat16" and resolve_lora(args.engine).dtype is None
    assert resolve_lora(parse_serve_args([]).engine) is None
    with pytest.raises(ConfigError, match="more than once"):
        resolve_lora(parse_serve_args(["--lora-modules", "a=/x", "a=/y"]).engine)
    with pytest.raises(ConfigError, match="pooling"):
        resolve_lora(parse_serve_args(["--enable-lora", "--runner", "pooling"]).engine)
    with pytest.raises(ConfigError, match="NAME=PATH"):
        parse_adapter_source("=/x")


def test_the_benchmark_runs_on_the_demo_model() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "lora.py"
    result = subprocess.run(
        [sys.executable, str(script), "--models", "demo", "--adapters", "1", "2", "--requests", "4", "--concurrency",
         "2", "--tokens", "4", "--prompt-tokens", "8", "--rank", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| demo |")]
    assert [row.split("|")[2].strip() for row in rows] == ["base model", "1", "2"]


def test_half_precision_weights_keep_their_adapters_half(setup: dict[str, Any]) -> None:
    """bf16 weights: the slots' native copies are bf16 too (what a decode step
    reads), and every request's first token still equals PEFT's in float32
    (later ones may part: the base's own weights are rounded too)."""
    llm = LLM(str(setup["checkpoint"]), dtype="bfloat16", enable_lora=True, lora_modules=_modules(setup))
    try:
        prompts, choices = _mixed_batch()
        outputs = llm.generate(prompts, GREEDY, lora_request=choices)
        layer = next(iter(llm.engine.lora.layers.values())) if llm.engine.lora else None
        if cpu_kernels() is not None:
            assert layer is not None and layer.lora is not None and layer.lora.native is not None
            assert layer.lora.native.a[1].dtype == torch.bfloat16
    finally:
        llm.close()
    expected = _expected(setup, prompts, choices)
    assert [o.token_ids[0] for o in outputs] == [tokens[0] for tokens in expected]


def test_lora_dtype_rounds_the_adapters_and_the_native_step_reads_them_at_that_width(setup: dict[str, Any]) -> None:
    """vLLM's --lora-dtype: a float32 model's adapters rounded to bf16. Every
    slot holds exactly the bf16 rounding of what the float32 run holds, the
    CPU's native copies are bf16 (half the bytes a decode step reads), and
    the native decode step and the modules (eager) give the same tokens, so
    both read the same rounded values; the first tokens still equal PEFT's."""
    prompts, choices = _mixed_batch()
    runs, slots = {}, {}
    for name, options in (("float32", {}), ("bf16", {"lora_dtype": "bfloat16"}),
                          ("bf16 eager", {"lora_dtype": "bfloat16", "cuda_graph": False})):
        llm = LLM(str(setup["checkpoint"]), dtype="float32", enable_lora=True, lora_modules=_modules(setup), **options)
        try:
            runs[name] = [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=choices)]
            assert llm.engine.lora is not None
            layer = next(iter(llm.engine.lora.layers.values()))
            assert layer.lora is not None and layer.lora.a.dtype == torch.float32
            slots[name] = (layer.lora.a.clone(), layer.lora.b.clone())
            if name == "bf16" and cpu_kernels() is not None:
                assert layer.lora.native is not None and layer.lora.native.a[1].dtype == torch.bfloat16
        finally:
            llm.close()
    a, b = slots["float32"]
    assert torch.equal(slots["bf16"][0], a.to(torch.bfloat16).float()) and not torch.equal(slots["bf16"][0], a)
    assert torch.equal(slots["bf16"][1], b.to(torch.bfloat16).float())
    assert runs["bf16"] == runs["bf16 eager"]
    expected = _expected(setup, prompts, choices)
    assert [tokens[0] for tokens in runs["bf16"]] == [tokens[0] for tokens in expected]
    from aioserve.config import ConfigError

    with pytest.raises(ConfigError, match="--lora-dtype"):
        LLM(str(setup["checkpoint"]), enable_lora=True, lora_dtype="int8")
