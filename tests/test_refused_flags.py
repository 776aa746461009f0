"""Every refused flag or flag combination ends `aioserve serve` with one
clear line on stderr and exit status 2 (a usage error), never a traceback:
refusals found by argparse, by the option dataclasses, and those found only
while the engine loads (the device, the checkpoint, the memory decide them)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import STORIES

REFUSED: dict[str, tuple[list[str], str]] = {
    "fp8_e5m2 KV cache": (["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2 is not supported"),
    "FlashInfer on a CPU": (["--attention-backend", "flashinfer", "--device", "cpu"], "flashinfer: it needs CUDA"),
    "an unknown dtype": (["--dtype", "float64"], "unknown dtype 'float64'"),
    "a CUDA device on a CPU machine": (["--device", "cuda"], "--device cuda"),
    "a context past the model's": (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
    "a page size of 0": (["--page-size", "0"], "--page-size must be at least 1"),
    "a memory fraction above 1": (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1]"),
    "reasoning without a parser": (["--enable-reasoning"], "--enable-reasoning needs --reasoning-parser"),
    "remote code": (["--trust-remote-code"], "never runs Python code shipped with a model"),
    "heads that do not divide over --tp": (["--tp", "3", "--device", "cpu"], "8 attention heads do not divide over 3"),
}


def refusal(args: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "aioserve", "serve", "--port", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def refusals() -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """Every case's `aioserve serve`, started at once: each spends its ~5 s
    importing torch, mostly waiting on the disk, so four side by side take
    about the time of two one after another."""
    with ThreadPoolExecutor(4) as pool:
        yield {case: pool.submit(refusal, ["--model", str(STORIES), *args]) for case, (args, _) in REFUSED.items()}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_refusal_is_one_line_and_a_usage_error(
    case: str, refusals: dict[str, Future[subprocess.CompletedProcess[str]]]
) -> None:
    args, expected = REFUSED[case]
    if case == "a CUDA device on a CPU machine":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    done = refusals[case].result()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "error:" in last and expected in last, done.stderr[-2000:]


def test_an_unserved_architecture_names_the_served_ones(tmp_path: Path) -> None:
    from aioserve.models.registry import MODEL_CLASSES

    (tmp_path / "config.json").write_text(json.dumps({**json.loads((STORIES / "config.json").read_text()),
                                                      "architectures": ["GPT2LMHeadModel"]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (STORIES / name).exists():
            (tmp_path / name).write_bytes((STORIES / name).read_bytes())
    done = refusal(["--model", str(tmp_path)])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "unsupported architecture 'GPT2LMHeadModel'" in last and all(name in last for name in MODEL_CLASSES)
