"""Build the real docker/Dockerfile, run the image, talk to it from the host.

Only three things differ from a user's build, all through build args and the
build context, never a second Dockerfile: the base image (a local Debian one,
since registries may be out of reach; BASE_IMAGE), the host's CA
certificates and its CPU torch wheel (docker/build-extras/; TORCH names the
wheel). Skipped, with the reason, when no Docker engine can be used or
started. A dockerd started here is stopped again; its images stay, so a
rerun reuses the base image and the build cache."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # server_process.py

from docker_host import (  # noqa: E402
    DockerClient,
    Dockerd,
    Unavailable,
    ensure_local_base,
    find_client,
    host_ca_certificates,
    place,
    torch_wheel,
)

from server_process import free_port, wait_for_health  # noqa: E402

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
IMAGE = "aioserve-test:latest"
LABEL = "aioserve-test=1"  # marks the test's images, so superseded builds can be pruned
# Greedy stories260K after "Once upon a time" (shared/models/README.md).
EXPECTED = ", there was a little girl named Lily. She loved to play"


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerClient]:
    dockerd = None
    try:
        client = find_client()
        if not client.engine_up():
            dockerd = Dockerd(client, tmp_path_factory.mktemp("dockerd") / "dockerd.log")
            dockerd.start()
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        yield client
    finally:
        if dockerd is not None:
            dockerd.stop()


def copy_build_context(target: Path) -> None:
    """What a fresh clone has (tracked and new, not ignored, files); the
    .dockerignore then picks from it as it would from a checkout."""
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=False
    )
    if listing.returncode != 0:  # not a git checkout: take what the Dockerfile copies
        for name in ("pyproject.toml", "README.md", ".dockerignore"):
            shutil.copy2(REPO / name, target / name)
        for name in ("aioserve", "native", "docker"):
            shutil.copytree(REPO / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return
    for name in listing.stdout.decode().split("\0"):
        source = REPO / name
        if name and source.is_file():  # a tracked file deleted in the work tree is skipped
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


@pytest.fixture(scope="module")
def image(docker: DockerClient, tmp_path_factory: pytest.TempPathFactory) -> str:
    version = torch.__version__
    wheel = torch_wheel(version)
    if wheel is None:
        pytest.skip(f"no torch-{version} wheel in pip's find-links: the build would download a CUDA torch")
    try:
        base = ensure_local_base(docker)
    except Unavailable as exc:
        pytest.skip(str(exc))
    context = tmp_path_factory.mktemp("context")
    copy_build_context(context)
    extras = context / "docker" / "build-extras"
    for source in [*host_ca_certificates(), wheel]:
        place(source, extras)
    start = time.monotonic()
    docker(
        "build", "--network", "host", "-f", "docker/Dockerfile", "--label", LABEL, "-t", IMAGE,
        "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"TORCH=torch=={version}", str(context),
        timeout=1800,
    )
    size = docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip()
    print(f"built {IMAGE} on {base} in {time.monotonic() - start:.0f} s: {int(size) / 1e9:.2f} GB")
    docker("image", "prune", "--force", "--filter", f"label={LABEL}")  # earlier builds, now untagged
    return IMAGE


def wait_healthy(url: str, container: str, docker: DockerClient, timeout: float) -> None:
    def gone() -> str | None:
        state = docker("inspect", "--format", "{{.State.Status}}", container).stdout.strip()
        return None if state == "running" else f"container {state}"

    why = wait_for_health(url, gone, timeout, interval=0.5)
    if why is not None:
        pytest.fail(f"{why}:\n{docker('logs', container, check=False).stderr[-4000:]}")


def test_the_image_serves_the_built_in_model(docker: DockerClient, image: str) -> None:
    port = free_port()
    name = f"aioserve-test-{port}"
    # No arguments: the entrypoint's `aioserve serve --host 0.0.0.0` alone.
    docker("run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:8000", image)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, name, docker, timeout=300)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["stories260K"]
        body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
        completion = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert completion["choices"][0]["text"] == EXPECTED

        log = docker("logs", name).stderr
        assert "built-in demo model" in log and "0.0.0.0:8000" in log
        assert docker("exec", name, "id", "-u").stdout.strip() != "0"  # not root
        assert docker("exec", name, "printenv", "HF_HOME").stdout.strip() == "/cache/huggingface"
        # FlashInfer's JIT kernels and the native CPU kernels live in the same cache volume.
        assert docker("exec", name, "printenv", "FLASHINFER_WORKSPACE_BASE").stdout.strip() == "/cache/flashinfer"
        native_cache = docker("exec", name, "printenv", "AIOSERVE_NATIVE_CACHE").stdout.strip()
        assert native_cache == "/cache/aioserve-native"
        # Built into the image, for this (the build's) CPU: the server started at full speed.
        assert docker("exec", name, "sh", "-c", f"ls {native_cache}/*/*.so").returncode == 0
        assert "building the native CPU kernels" not in log
        assert docker("exec", name, "cat", "/proc/1/comm").stdout.strip() == "tini"  # an init reaps children
        # No layer holds the build extras (the torch wheel, certificates): they stayed in the build stage.
        history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
        assert "build-extras" not in history, history
        wheels = docker("exec", name, "sh", "-c", "find / -xdev -name '*.whl' 2>/dev/null", check=False).stdout
        assert not wheels.strip(), wheels

        # Docker's own HEALTHCHECK (every 10 s) agrees.
        deadline = time.monotonic() + 60
        while docker("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip() != "healthy":
            assert time.monotonic() < deadline, docker("inspect", "--format", "{{json .State.Health}}", name).stdout
            time.sleep(1)

        # SIGTERM reaches the server (through tini) and it shuts down cleanly, well before docker's SIGKILL.
        start = time.monotonic()
        docker("stop", "--time", "30", name, timeout=60)
        assert time.monotonic() - start < 25
        assert docker("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"
    finally:
        docker("rm", "--force", name, check=False)
