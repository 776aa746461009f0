"""Shared fixtures: tiny checkpoints (built once per session), the real
shared/ checkpoints when present, and a CUDA skip for `gpu` tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # server_process.py

from tiny_models import ARCHITECTURES, build_checkpoint, build_tokenizer  # noqa: E402

from aioserve.models.source import DEMO_MODEL_DIR  # noqa: E402

SHARED = Path(os.environ.get("AIOSERVE_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
# stories260K ships inside the package (the built-in demo model), so the suite
# needs nothing outside the repository; AIOSERVE_STORIES points elsewhere.
STORIES = Path(os.environ.get("AIOSERVE_STORIES", DEMO_MODEL_DIR))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub lookups from tests
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_sessionstart(session: pytest.Session) -> None:
    # Build (or load) the native kernels before any test runs: an engine
    # started while they build serves with the torch twins and switches to
    # them mid-run, and outputs compared across runs must come from one path.
    # As `aioserve serve` does, with its progress lines on the console.
    from aioserve.cpu.native import build_with_progress

    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        build_with_progress()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_checkpoint(name, root / name) for name in ARCHITECTURES}


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "model.safetensors").exists():
        pytest.skip(f"stories260K not found at {STORIES}")
    return STORIES


@pytest.fixture(scope="session")
def templateless_stories_path(stories_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of stories260K without the chat template it ships with: for the
    paths a model without one takes (a 400 on chat, the page's completion mode)."""
    import shutil

    folder = tmp_path_factory.mktemp("stories-no-template")
    for item in stories_path.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def templateless_server(templateless_stories_path: Path):
    """stories260K without a chat template."""
    from server_harness import start_server

    server = start_server(templateless_stories_path, "--served-model-name", "stories260K", "--page-size", "4")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stories_server(stories_path: Path):
    """The real server on stories260K, shared by the HTTP tests."""
    from server_harness import start_server

    server = start_server(stories_path, "--page-size", "4", "--debug-integrity")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def chat_server(tiny_checkpoints: dict[str, Path]):
    """A tiny Llama with a ChatML template, for chat tests."""
    from server_harness import start_server

    server = start_server(tiny_checkpoints["llama"], "--served-model-name", "tiny-chat", "--page-size", "4")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory) -> Path:
    """A config (no weights: served with --load-format dummy) big enough that
    a 2,000-token prefill takes a while on a CPU."""
    folder = tmp_path_factory.mktemp("wide")
    build_tokenizer(folder)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 400, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "eos_token_id": 2, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def wide_server(wide_model: Path):
    from server_harness import start_server

    # On the CPU: the tests need a prefill long enough to watch the loop
    # answer during it, which a GPU finishes in milliseconds.
    server = start_server(
        wide_model, "--load-format", "dummy", "--max-prefill-tokens", "4096", "--page-size", "4", "--device", "cpu"
    )
    yield server
    server.stop()


# -- shared by the HTTP test modules: one client per server, and the KV check -------------
# These were repeated in test_server_api.py, test_openapi_spec.py and
# test_generate_endpoint.py; session scope, since they wrap session-scoped servers.


@pytest.fixture(scope="session")
def stories_client(stories_server):
    import openai

    return openai.OpenAI(base_url=stories_server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def stories_model(stories_client) -> str:
    return stories_client.models.list().data[0].id


@pytest.fixture(scope="session")
def chat_client(chat_server):
    import openai

    return openai.OpenAI(base_url=chat_server.v1, api_key="unused", max_retries=0, timeout=120)


def assert_kv_intact(server) -> None:
    """Once the server is idle, every KV page is free or an unlocked prefix-cache
    page again, and the pool's own consistency check passes: a request that
    leaked or double-freed a page shows up here, right after the test that did it."""
    info = server.wait_idle(timeout=30.0)  # generous: 2 shared cores can be slow to drain
    assert info["kv_integrity"] == "ok"
    assert info["kv_pages_free"] + info["kv_pages_evictable"] == info["kv_pages_total"]


@pytest.fixture()
def stories_kv_intact(stories_server):
    """Use with `pytestmark = pytest.mark.usefixtures("stories_kv_intact")`."""
    yield
    assert_kv_intact(stories_server)
