"""The house rules of imports: every package sits on one level and nothing
imports upward (server -> launch, with tensor parallelism's processes ->
scheduler -> engine -> cpu_engine -> models -> attention -> kvcache ->
quantised checkpoints -> layers -> FlashInfer's kernels -> the CPU kernels
-> tp's transport, with plain-data modules at the bottom), and no module
imports itself back through others. Lazy imports inside functions count
too. The same rules are checked on the package graph (no upward arrow
between packages, no loop through them), and docs/architecture.md's layer
table draws these ranks."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Set
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aioserve"

# Higher imports lower; within one package anything goes (acyclic, below).
# A package is ranked whole: no module is ranked apart from its package.
RANKS: dict[str, float] = {
    "__init__": 10, "__main__": 9.6, "cli": 9.4, "data_parallel": 9.3, "dp_metrics": 9.25, "runtime": 9.2,
    "server": 8, "llm": 8,
    "launch": 7.5,  # the wiring and tensor parallelism's processes (world, leader, follower)
    "output_stream": 7, "grammar": 6.7, "tokenizer": 6.5,
    "images": 6.5,  # a prompt's images read, decoded, processed; beside the tokenizer, independent of it
    "scheduler": 6,
    "engine": 5, "cpu_engine": 4.8,  # the engine's CPU fast paths: they read the model and the KV pool
    "lora": 4.6,  # LoRA adapters read for the model's layers, and the engine's slots
    "models": 4.5, "attention": 4,  # a model's forward takes the attention backend's metadata
    "kvcache": 3,
    "quant": 2.5,  # quantised checkpoints: the loader asks it, and it gives linear layers their quantised product
    "layers": 2, "flashinfer": 1.8, "cpu": 1.5,  # the layers call FlashInfer's kernels and the CPU's
    "tp": 1,  # the TP group's collectives and the plan's transport: the layers call them
    "speculative_config": 0.5,  # reads config's ConfigError and EngineConfig
    "pooling_config": 0.5,  # likewise: a pooling model's pooling, from its folder and the flags
    "lora_config": 0.5,  # likewise: the LoRA flags, the adapters named at start
    "config": 0, "sampling_params": 0, "batch_plan": 0, "placeholders": 0, "hf_imports": 0, "image_inputs": 0,
    "sampling_limits": -1,  # the ranges of the sampling fields: sampling_params reads them
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def project_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("aioserve"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("aioserve"))
    return found


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank(module: str) -> float:
    return RANKS[top(module)]


def graph() -> dict[str, set[str]]:
    return {module_name(p): project_imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_rank() -> None:
    assert {top(m) for m in graph()} <= set(RANKS), "give new top-level modules a rank in RANKS"


def test_nothing_imports_upward() -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in targets
        if top(module) != top(target) and rank(target) >= rank(module)
    ]
    assert not upward, upward


def package_graph() -> dict[str, set[str]]:
    """Each package (or top-level module) -> the other ones it imports."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph().items():
        packages.setdefault(top(module), set()).update(top(t) for t in targets if top(t) != top(module))
    return packages


def find_cycle(edges: Mapping[str, Set[str]]) -> list[str] | None:
    """One cycle through `edges` (an edge to a node not in it is ignored), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(edges[node]):
            if target not in edges or target == node:
                continue
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target, path + [target])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycles() -> None:
    # `from aioserve.scheduler import X` imports the package's __init__ (a node of the graph).
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_packages_sit_on_one_level_each() -> None:
    """The package graph: no arrow goes up or sideways, and no loop runs
    through packages (which module-level acyclicity alone would allow)."""
    packages = package_graph()
    upward = sorted(f"{package} -> {target}" for package, targets in packages.items()
                    for target in targets if RANKS[target] >= RANKS[package])
    assert not upward, upward
    cycle = find_cycle(packages)
    assert cycle is None, "package loop: " + " -> ".join(cycle or [])


def architecture_layers() -> list[tuple[str, set[str]]]:
    """docs/architecture.md's layer table, top to bottom: (layer, the
    top-level packages and modules its "where" column names)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = text.split("| layer | where | what it is |", 1)[1].split("\n\n", 1)[0]
    layers = []
    for line in table.strip().splitlines()[1:]:
        name, where = line.split("|")[1:3]
        names = {n.rstrip("/").removesuffix(".py") for n in re.findall(r"`([^`]+)`", where)}
        layers.append((name.strip(), names))
    return layers


def test_the_architecture_map_draws_the_ranks() -> None:
    """The layer table of docs/architecture.md names every ranked package
    once, and its rows go down the ranks: each row's lowest rank is above
    the next row's highest."""
    layers = architecture_layers()
    named = [n for _, names in layers for n in names]
    assert sorted(named) == sorted(set(named)), "a package named twice in the layer table"
    assert set(named) == set(RANKS), f"not in the table: {set(RANKS) - set(named)}; unknown: {set(named) - set(RANKS)}"
    for (upper, above), (lower, below) in zip(layers, layers[1:]):
        assert min(RANKS[n] for n in above) > max(RANKS[n] for n in below), f"{upper} is not above {lower}"
