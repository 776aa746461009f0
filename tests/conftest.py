"""Shared fixtures: tiny checkpoints (built once per session), the real
shared/ checkpoints when present, and a CUDA skip for `gpu` tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ARCHITECTURES, build_checkpoint  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES = Path(os.environ.get("AIOSERVE_STORIES", SHARED / "models" / "stories260K"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub lookups from tests
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
