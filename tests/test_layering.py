"""The house rules of imports: nothing imports upward (server -> launch ->
tp's processes -> scheduler -> engine -> attention/models -> layers -> the
CPU kernels -> tp's collectives, with plain-data modules at the bottom) and
no module imports itself back through others. Lazy
imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aioserve"

# Higher imports lower; within one package anything goes (acyclic, below).
RANKS: dict[str, float] = {
    "__init__": 10, "__main__": 9.6, "cli": 9.4, "data_parallel": 9.3, "runtime": 9.2,
    "server": 8, "llm": 8,
    "launch": 7.5, "tp": 7,  # tp's processes (world, leader, follower); its low modules in MODULE_RANKS
    "output_stream": 7, "grammar": 6.7, "tokenizer": 6.5,
    "scheduler": 6,
    "engine": 5, "cpu_engine": 4.8,  # the engine's CPU fast paths: they read the model and the KV pool
    "models": 4.5, "attention": 4,  # a model's forward takes the attention backend's metadata
    "kvcache": 3,
    "layers": 2, "kernel_contracts": 1.8, "cpu": 1.5,
    "config": 0, "sampling_params": 0, "batch_plan": 0, "placeholders": 0, "hf_imports": 0,
}
# Modules ranked apart from their package.
MODULE_RANKS: dict[str, float] = {
    # tp/: what the layers and the engine use sits low; the process management above the scheduler.
    "tp.layout": 4.9, "tp.channel": 1.2, "tp.distributed": 1, "tp.codec": 0.5, "tp.lifeline": 0.5,
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


def unit(module: str) -> str:
    """What a module is ranked as: itself where MODULE_RANKS names it, else its package."""
    name = module.removeprefix("aioserve.")
    return name if name in MODULE_RANKS else top(module)


def rank(module: str) -> float:
    return MODULE_RANKS.get(unit(module), RANKS[top(module)])


def graph() -> dict[str, set[str]]:
    return {module_name(p): project_imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_rank() -> None:
    assert {top(m) for m in graph()} <= set(RANKS), "give new top-level modules a rank in RANKS"


def test_nothing_imports_upward() -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in targets
        if unit(module) != unit(target) and rank(target) >= rank(module)
    ]
    assert not upward, upward


def test_no_import_cycles() -> None:
    edges = graph()

    def resolve(target: str) -> str | None:
        # `from aioserve.scheduler import X` imports the package's __init__.
        return target if target in edges else None

    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            target = resolve(target) or ""
            if not target or target == module:
                continue
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
