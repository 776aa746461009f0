"""The house rules inside server/: its rooms and its shared modules stand in
one order, each importing only what stands below it, so no loop runs
through them (tests/test_layering.py ranks server/ whole, among the
packages; this is the same rule one level down). Lazy and type-checking
imports count too."""

from __future__ import annotations

from test_layering import PACKAGE, find_cycle, graph

SERVER = "aioserve.server"

# Highest first: a room (a folder) or a shared module (a file) imports only
# those after it.
ORDER = (
    "endpoints",  # the app, the route table, the handlers
    "openapi",  # the document: reads the request models and the response bodies
    "output",  # generation, content processing, response bodies, SSE
    "intake",  # reading the body into the request models, and their checks
    "context",  # what every handler needs
    "request_metrics",
    "errors",
    "wire",
    "body",  # the raw JSON body, standard library only (the worker process imports no aioserve)
)


def room(module: str) -> str | None:
    """The room or shared module of server/ that `module` is in, if any."""
    parts = module.split(".")
    if parts[:2] != SERVER.split(".") or len(parts) < 3:
        return None
    return parts[2]


def room_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, targets in graph().items():
        source = room(module)
        if source is not None:
            edges.setdefault(source, set()).update(
                target for t in targets if (target := room(t)) is not None and target != source
            )
    return edges


def test_every_room_has_a_place() -> None:
    on_disk = {p.stem for p in (PACKAGE / "server").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert on_disk - {"__init__"} == set(ORDER), "give each room and shared module of server/ a place in ORDER"


def test_rooms_import_only_downward() -> None:
    place = {name: index for index, name in enumerate(ORDER)}
    upward = sorted(
        f"{source} -> {target}" for source, targets in room_graph().items()
        for target in targets if place[target] <= place[source]
    )
    assert not upward, upward
    assert find_cycle(room_graph()) is None


def test_the_body_room_imports_nothing_of_aioserve() -> None:
    """body/worker.py runs as a plain script beside checks.py and cost.py
    (each imported by its bare name there): an aioserve import there would
    pull in torch, or fail."""
    imported = {t for m, targets in graph().items() if room(m) == "body" for t in targets}
    assert imported <= {f"{SERVER}.body.checks", f"{SERVER}.body.cost"}, sorted(imported)
