"""The module graph of ``ortbatch`` runs one way (docs/architecture.md): no circle, no
import back up a floor, no private name taken from another module.

The graph is read from the source with :mod:`ast`, so every import counts: those at the
top of a module, those inside functions (lazy) and those under ``TYPE_CHECKING``. An
edge goes to the module that is imported, or, for ``from package import name``, to the
submodule ``name`` when there is one (else to the package itself).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "ortbatch"

#: the ground floor: imported by every room, imports none of them
GROUND = (
    "ortbatch._ort",
    "ortbatch.manifest",
    "ortbatch.errors",
    "ortbatch._lifecycle",
    "ortbatch._extras",
    "ortbatch._observe",
    "ortbatch._version",
)
#: what the two runtimes never import
ABOVE_RUNTIMES = (
    "ortbatch.serve",
    "ortbatch.export",
    "ortbatch.ray",
    "ortbatch.commands",
    "ortbatch.bench",
    "ortbatch.cli",
    "ortbatch.bulk",
)

#: private names imported across modules in files the ``funcs`` branch rewrites
#: (ortbatch/export, commands, bench, runtime): importer -> (module, name). Emptied
#: once that branch is merged; nothing in serve/ may be added here.
PRIVATE_IMPORTS_ALLOWED: frozenset[tuple[str, str, str]] = frozenset()


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None) -> str:
    base = importer.split(".")
    if not _is_package(importer):
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


@cache
def imports() -> tuple[tuple[str, str, str | None], ...]:
    """``(importer, imported module, name or None)`` for every import inside ortbatch."""
    known = modules()
    found = []
    for importer, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(importer, a.name, None) for a in node.names if a.name.split(".")[0] == "ortbatch"]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(importer, node.level, node.module) if node.level else (node.module or "")
                if target.split(".")[0] != "ortbatch":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    # `from package import submodule` imports the submodule, not a name
                    found.append((importer, sub, None) if sub in known else (importer, target, alias.name))
    return tuple(found)


def edges() -> set[tuple[str, str]]:
    known = modules()
    out = set()
    for importer, target, _ in imports():
        while target not in known and "." in target:  # `import ortbatch.x.y` of an attribute
            target = target.rsplit(".", 1)[0]
        if target != importer:
            out.add((importer, target))
    return out


def _inside(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


def _crossing(importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted(
        (a, b) for a, b in edges() if any(_inside(a, r) for r in importers) and any(_inside(b, r) for r in forbidden)
    )


def _cycles() -> Iterator[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {m: [] for m in modules()}
    for a, b in edges():
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = [0]

    def visit(v: str) -> Iterator[list[str]]:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                yield from visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                yield sorted(component)

    for v in sorted(graph):
        if v not in index:
            yield from visit(v)


def test_the_graph_is_read():
    """The checks below would pass on an empty graph: make sure it is not one."""
    assert ("ortbatch.serve.server", "ortbatch.serve.assembly") in edges()
    # a lazy import (inside a function) is an edge too
    assert ("ortbatch.serve.server", "ortbatch.serve.frontends") in edges()


def test_no_import_circle():
    assert list(_cycles()) == []


def test_the_ground_floor_imports_nothing_above_it():
    above = tuple(m for m in modules() if m != "ortbatch" and not any(_inside(m, g) for g in GROUND))
    assert _crossing(GROUND, above) == []


@pytest.mark.parametrize("room", ["ortbatch.runtime", "ortbatch.generation"])
def test_the_runtimes_never_import_the_rooms_above(room):
    assert _crossing((room,), ABOVE_RUNTIMES) == []


SERVE = "ortbatch.serve"
#: serve's own floor: read by every layer of serve, imports none of them
SERVE_FLOOR = (f"{SERVE}.config", f"{SERVE}.auth", f"{SERVE}.metrics", f"{SERVE}.tracing")
CORE = f"{SERVE}.served"
HTTP = f"{SERVE}.http"
GRPC = f"{SERVE}.grpc"
#: what assembles and runs a server, above both transports
RUNNERS = (f"{SERVE}.listen", f"{SERVE}.assembly", f"{SERVE}.server", f"{SERVE}.frontends", "ortbatch.ray")


def _imports_package(importers: tuple[str, ...], package: str) -> list[tuple[str, str]]:
    """Edges from ``importers`` to ``package`` itself (its ``__init__``, which loads it all)."""
    return sorted((a, b) for a, b in edges() if any(_inside(a, r) for r in importers) and b == package)


def test_serves_floor_imports_nothing_of_serve():
    rest = tuple(m for m in modules() if _inside(m, SERVE) and m not in SERVE_FLOOR and m != SERVE)
    assert _crossing(SERVE_FLOOR, rest) == []
    assert _imports_package(SERVE_FLOOR, SERVE) == []
    # nor each other
    for floor in SERVE_FLOOR:
        assert _crossing((floor,), tuple(f for f in SERVE_FLOOR if f != floor)) == []


def test_the_core_knows_no_transport_and_no_runner():
    assert _crossing((CORE,), (HTTP, GRPC, *RUNNERS)) == []
    assert _imports_package((CORE,), SERVE) == []


def test_http_and_grpc_never_import_each_other_nor_the_runners():
    assert _crossing((HTTP,), (GRPC, *RUNNERS)) == []
    assert _crossing((GRPC,), (HTTP, *RUNNERS)) == []
    assert _imports_package((HTTP, GRPC), SERVE) == []


def test_assembly_and_listen_never_import_the_runners():
    runners = (f"{SERVE}.server", f"{SERVE}.frontends", "ortbatch.ray")
    assert _crossing((f"{SERVE}.assembly", f"{SERVE}.listen"), runners) == []


BULK = "ortbatch.bulk"


def test_bulk_uses_serves_core_only():
    """``ortbatch run`` answers Batch API completion lines with serve's transport-free core: it may
    import ``serve.served`` (and so what the core imports), never serve's package itself, its
    transports, its runners or front ends; and serve never imports bulk."""
    into_serve = [(a, b) for a, b in edges() if _inside(a, BULK) and _inside(b, SERVE)]
    assert [(a, b) for a, b in into_serve if not _inside(b, CORE)] == []
    assert _crossing((SERVE,), (BULK,)) == []
    # the rule is not empty: bulk does use the core
    assert into_serve


def test_no_private_name_is_imported_across_modules():
    private = {
        (importer, target, name)
        for importer, target, name in imports()
        if name is not None and name.startswith("_") and not name.startswith("__") and target != importer
    }
    assert sorted(private - PRIVATE_IMPORTS_ALLOWED) == []
    # the allow-list only shrinks: an entry no longer imported is taken out of it
    assert sorted(PRIVATE_IMPORTS_ALLOWED - private) == []
    assert not [entry for entry in PRIVATE_IMPORTS_ALLOWED if _inside(entry[0], SERVE)]
