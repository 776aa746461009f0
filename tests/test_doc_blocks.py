"""Every ```sh, ```bash and ```python block of README.md and docs/guide/*.md
runs, as written, against a live server on the demo model.

The blocks address the server as http://127.0.0.1:8000 (the default); the
test rewrites that to the server it started. A block that cannot run here is
marked on the line before its fence with `<!-- skip: why -->` and is skipped
with that reason. An unmarked block that installs packages, starts a server
or runs Docker fails: it must say why it is skipped. Python blocks run with
this interpreter, shell blocks with `bash -e`, each in a process of its own
with this environment's bin/ first on PATH (`aioserve`, `python`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from server_harness import start_server

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]
LANGUAGES = {"sh": "shell", "bash": "shell", "python": "python"}
ADDRESS = "http://127.0.0.1:8000"
README_MAX_LINES = 150
BLOCK_TIMEOUT = 60

FENCE = re.compile(r"^```(\w+)\s*$")
SKIP = re.compile(r"^<!--\s*skip:\s*(.+?)\s*-->\s*$")
# What an unmarked block must not do: the test starts its own server and
# installs nothing.
FORBIDDEN = re.compile(
    r"\bpip3? install\b|\baioserve serve\b(?!\s+--help)|\bpython3? -m aioserve serve\b(?!\s+--help)"
    r"|\bdocker\b|\bapt(-get)? install\b|\blaunch_router\b"
)


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # "shell" or "python"
    code: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{start + 1}: unclosed code fence"
        language = LANGUAGES.get(match.group(1))
        if language is not None:
            marker = SKIP.match(lines[start - 1]) if start > 0 else None
            found.append(Block(path, start + 1, language, "\n".join(lines[start + 1:end]) + "\n",
                               marker.group(1) if marker else None))
        i = end + 1
    return found


BLOCKS = [block for path in DOCUMENTS for block in blocks_of(path)]


def test_the_documents_have_blocks_to_run() -> None:
    assert (ROOT / "docs" / "guide").is_dir() and len(DOCUMENTS) > 1
    assert sum(block.skip is None for block in BLOCKS) >= 5


def test_the_readme_reads_in_one_sitting() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, more than {README_MAX_LINES}"


def test_ci_runs_the_readmes_test_command() -> None:
    """.ci/run ends with exactly the README's second command (the tests)."""
    first = blocks_of(README)[0]
    serve, test = first.code.strip().splitlines()
    assert "aioserve serve" in serve and ".[test]" not in serve  # serving installs the package alone
    assert "pytest" in test
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test


def test_the_readme_lists_every_endpoint() -> None:
    from aioserve.server.openapi.docs_routes import DOCS_INIT
    from aioserve.server.endpoints.routes import ENDPOINTS

    text = README.read_text()
    for endpoint in ENDPOINTS:
        if endpoint.path == DOCS_INIT:  # Swagger UI's own script, not an endpoint anyone calls
            continue
        shown = endpoint.path.replace("{model:path}", "{id}")
        assert f"`{endpoint.method} {shown}`" in text or f"`{shown}`" in text, f"README.md does not list {shown}"


def test_every_relative_link_leads_to_a_file() -> None:
    for path in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            assert (path.parent / target.split("#")[0]).exists(), f"{path.relative_to(ROOT)} links to {target}, which is not there"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_an_unmarked_block_starts_and_installs_nothing(block: Block) -> None:
    if block.skip is None:
        assert not FORBIDDEN.search(block.code), (
            f"{block.name} installs packages, starts a server or runs Docker: mark it with "
            "<!-- skip: why --> on the line before its fence"
        )


@pytest.fixture(scope="module")
def server(stories_path: Path):
    server = start_server(stories_path, "--num-threads", "1")
    yield server
    server.stop()


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_the_block_runs(block: Block, server, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    assert not FORBIDDEN.search(block.code)  # see test_an_unmarked_block_starts_and_installs_nothing
    code = block.code.replace(ADDRESS, server.url)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("AIOSERVE_API_KEY", None)
    if block.language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-e", "-c", code]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    assert result.returncode == 0, (
        f"{block.name} failed ({result.returncode}):\n{block.code}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-3000:]}\n--- server log\n{server.log()[-2000:]}"
    )
    assert (result.stdout + result.stderr).strip(), f"{block.name} printed nothing"
