"""Where `--model` comes from: the demo model built into the package (and
into its sdist and wheel), local folders, and Hugging Face ids through the
hub cache, offline included. Hub tests run in subprocesses because
huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, at import."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from aioserve.config import DEMO_MODEL
from aioserve.models.model_config import ModelConfig
from aioserve.models.source import DEMO_MODEL_DIR, resolve_model_path
from server_process import free_port

REPO = Path(__file__).resolve().parents[1]
DEMO_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json", "LICENSE", "ORIGIN.md",
}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_the_demo_model_is_a_complete_checkpoint() -> None:
    from transformers import AutoTokenizer

    path = resolve_model_path(DEMO_MODEL)
    assert path == DEMO_MODEL_DIR and {p.name for p in path.iterdir()} >= DEMO_FILES
    config = ModelConfig.from_path(path)
    assert (config.architecture, config.vocab_size, config.num_layers) == ("LlamaForCausalLM", 512, 5)
    # The ids shared/models/README.md documents for this tokenizer.
    assert AutoTokenizer.from_pretrained(str(path))("Once upon a time").input_ids == [1, 403, 407, 261, 378]
    assert "MIT License" in (path / "LICENSE").read_text() and "llama2.c" in (path / "ORIGIN.md").read_text()


def test_a_local_folder_wins_and_a_missing_one_is_not_asked_of_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / DEMO_MODEL).mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(DEMO_MODEL) == Path(DEMO_MODEL)  # a folder of that name comes first
    for path in ("./no/such/model", str(tmp_path / "absent"), "a/b/c"):
        with pytest.raises(FileNotFoundError, match="no such folder"):
            resolve_model_path(path)


def test_llm_without_a_model_runs_the_demo_model(caplog: pytest.LogCaptureFixture) -> None:
    from aioserve import LLM, SamplingParams

    with caplog.at_level(logging.INFO, logger="aioserve.models.source"):
        llm = LLM(page_size=4)
    try:
        out = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0))[0]
    finally:
        llm.close()
    assert out.text == ", there was a little girl named Lily. She loved to play"
    assert "built-in demo model" in caplog.text


def run_python(code: str, hf_home: Path, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", **env)
    environ.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)


def fake_cached_snapshot(hf_home: Path, repo_id: str, commit: str, ref: str) -> Path:
    """The hub cache's layout, written by hand: refs/<ref> names a commit,
    snapshots/<commit>/ holds the files (symlinks into blobs/ in a real cache;
    plain files read the same)."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(DEMO_MODEL_DIR, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_a_cached_hub_model_resolves_offline(tmp_path: Path) -> None:
    main = fake_cached_snapshot(tmp_path, "fake-org/tiny", COMMIT, "main")
    tagged = fake_cached_snapshot(tmp_path, "fake-org/tiny", COMMIT[::-1], "v2")
    code = (
        "import json; from aioserve.models.source import resolve_model_path as r; "
        "print(json.dumps([str(r('fake-org/tiny')), str(r('fake-org/tiny', 'v2')), str(r('fake-org/tiny', '"
        + COMMIT + "'))]))"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [str(main), str(tagged), str(main)]
    missing = run_python("from aioserve.models.source import resolve_model_path as r; r('fake-org/tiny', 'v3')", tmp_path)
    assert missing.returncode != 0 and "'fake-org/tiny' (revision v3) is neither a local folder" in missing.stderr


def serve_and_fail(model: str, hf_home: Path, **env: str) -> tuple[float, str]:
    environ = dict(os.environ, HF_HOME=str(hf_home), **env)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "aioserve", "serve", "--model", model, "--port", str(free_port())],
        capture_output=True, text=True, env=environ, timeout=120,
    )
    assert result.returncode != 0
    return time.monotonic() - start, result.stderr


def test_serve_offline_with_an_uncached_id_fails_at_once(tmp_path: Path) -> None:
    took, err = serve_and_fail("some-org/not-cached", tmp_path, HF_HUB_OFFLINE="1")
    # Start-up (torch, transformers) is most of it; a retry loop would take minutes.
    assert took < 30, took
    assert "'some-org/not-cached' is neither a local folder nor in the Hugging Face cache" in err
    assert "HF_HUB_OFFLINE is set" in err and str(tmp_path) in err


def test_serve_with_an_unreachable_hub_fails_at_once(tmp_path: Path) -> None:
    # A closed local port as the hub: the connection is refused at once.
    took, err = serve_and_fail(
        "some-org/not-cached", tmp_path, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}"
    )
    assert took < 30, took
    assert "the Hugging Face hub cannot be reached" in err


def test_sdist_and_wheel_carry_the_demo_model(tmp_path: Path) -> None:
    """`python -m build` makes the sdist, then the wheel from it: the model
    must survive both steps."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "aioserve", source / "aioserve", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    in_sdist = {Path(n).name for n in tarfile.open(sdist).getnames() if "/aioserve/demo_model/" in n}
    in_wheel = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("aioserve/demo_model/")}
    assert in_sdist >= DEMO_FILES and in_wheel >= DEMO_FILES
    weights = zipfile.ZipFile(wheel).read("aioserve/demo_model/model.safetensors")
    assert weights == (DEMO_MODEL_DIR / "model.safetensors").read_bytes()
    # Chat works on a fresh install: the demo model's chat template is in the wheel.
    assert json.loads(zipfile.ZipFile(wheel).read("aioserve/demo_model/tokenizer_config.json"))["chat_template"]
