"""The import graph of `wcd/`: every module sits on one floor, imports only from its own floor or
lower ones, and no modules import each other round a circle. Imports made inside functions and
under TYPE_CHECKING count too (a lazy import is still a dependency). ARCHITECTURE.md draws it."""

from __future__ import annotations

import ast
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A new module gets a line here; a pattern names modules that may not exist yet.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("wcd", "wcd.errors", "wcd.units", "wcd.peers", "wcd.gcpause", "wcd.logsink", "wcd.systemd",
                    "wcd.workers", "wcd.configfile", "wcd.pagecache", "wcd.offloop", "wcd.tuning")),
    ("formats", ("wcd.manifest", "wcd.wire", "wcd.headers", "wcd.header_helpers", "wcd.checkpoint", "wcd.key")),
    ("arenas", ("wcd.arenas", "wcd.arenas.*")),
    ("loader", ("wcd.loader",)),
    ("daemon", ("wcd.config", "wcd.series", "wcd.entry", "wcd.leasebook", "wcd.cache", "wcd.protocol",
                "wcd.connection", "wcd.state", "wcd.metrics", "wcd.metrics_http", "wcd.parking", "wcd.shutdown",
                "wcd.publishes", "wcd.residency", "wcd.life", "wcd.adoption", "wcd.verifying", "wcd.watch",
                "wcd.devices", "wcd.refusals", "wcd.socketpath", "wcd.ops", "wcd.server", "wcd.fleet", "wcd.fleet.*")),
    ("clients", ("wcd.views", "wcd.replies", "wcd.lease", "wcd.publishing", "wcd.client", "wcd.follower",
                 "wcd.demo", "wcd.integrations", "wcd.integrations.*")),
    ("commands", ("wcd.cli", "wcd.cli.*", "wcd.__main__")),
)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "wcd").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The wcd modules `path` imports (the longest known prefix of each imported name)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def floor_of(module: str) -> int:
    floors = [i for i, (_, patterns) in enumerate(FLOORS) if any(fnmatchcase(module, p) for p in patterns)]
    assert len(floors) == 1, f"{module} is on {len(floors)} floors: give it one in FLOORS"
    return floors[0]


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a higher floor, in words (a package choosing among its own modules aside)."""
    return [f"{m} ({FLOORS[floor_of(m)][0]}) imports {d} ({FLOORS[floor_of(d)][0]})"
            for m, deps in sorted(graph.items()) for d in sorted(deps)
            if floor_of(d) > floor_of(m) and not d.startswith(m + ".")]


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Each circle of imports found by a depth-first walk, as "a -> b -> a"."""
    done: set[str] = set()
    found: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            found.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            if not dep.startswith(module + "."):  # a package's __init__ choosing among its own modules
                visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports(path, known) - {module} for module, path in known.items()}


def test_every_module_is_on_one_floor(graph: dict[str, set[str]]) -> None:
    for module in graph:
        floor_of(module)


def test_no_module_imports_from_a_higher_floor(graph: dict[str, set[str]]) -> None:
    assert not upward(graph), "\n".join(upward(graph))


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    assert not circles(graph), "\n".join(circles(graph))


def test_the_checks_find_what_they_look_for(graph: dict[str, set[str]]) -> None:
    """An upward import and a circle added to the real graph are reported, and nothing else."""
    bent = {module: set(deps) for module, deps in graph.items()}
    bent["wcd.key"].add("wcd.server")  # formats -> daemon
    bent["wcd.manifest"].add("wcd.key")  # key -> ... -> manifest already: now a circle
    assert upward(bent) == ["wcd.key (formats) imports wcd.server (daemon)"]
    assert any("wcd.manifest -> wcd.key" in c for c in circles(bent))
    assert "wcd.errors" in graph["wcd.server"] and "wcd.ops" in graph["wcd.server"]  # the reader reads imports
