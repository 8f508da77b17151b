"""Dependencies point one way: shared library <- services <- command line <- benchmark harness.

Walks every import statement (module level and inside functions) of the `specdec` package
and the benchmark harness and fails on:
- an upward import (the library importing a service or the command line, a service
  importing the command line, anything under `specdec` importing the harness: `specdec bench`
  comes from the harness's entry point, `specdec.commands`);
- one service importing another (they talk over gRPC only);
- a cycle between the library's subpackages (e.g. `specdec.model` <-> `specdec.serving`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"specdec": ROOT / "specdec", "specdec_bench": ROOT / "benchmarks" / "specdec_bench"}
SERVICES = ("specdec.gateway", "specdec.draft_server", "specdec.target_server")
COMMAND_LINE = ("specdec.cli",)
HARNESS = ("specdec_bench",)
LAYER_NAMES = {1: "library", 2: "service", 3: "command line", 4: "benchmark harness"}


def _within(module: str, packages: tuple[str, ...]) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def layer(module: str) -> int:
    if _within(module, HARNESS):
        return 4
    if _within(module, COMMAND_LINE):
        return 3
    if _within(module, SERVICES):
        return 2
    return 1


def library_unit(module: str) -> str:
    """The library subpackage (or top-level module) a module belongs to: specdec.model, specdec.errors, ..."""
    return ".".join(module.split(".")[:2])


def module_name(path: Path, package: str, root: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, module: str) -> Iterator[str]:
    """Every first-party module `path` imports (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base]
        else:
            continue
        for name in names:
            if name.split(".")[0] in SOURCES:
                yield name


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated stubs import only each other
            module = module_name(path, package, root)
            graph[module] = set(imports_of(path, module))
    return graph


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            if layer(target) > layer(importer):
                found.append(f"{importer} ({LAYER_NAMES[layer(importer)]}) "
                             f"imports {target} ({LAYER_NAMES[layer(target)]})")
            here, there = _within(importer, SERVICES), _within(target, SERVICES)
            if here and there and here != there:
                found.append(f"service {importer} imports another service: {target}")
    return found


def library_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between library subpackages, each as the path that closes it."""
    units: dict[str, set[str]] = {}
    for importer, imported in graph.items():
        if layer(importer) == 1:
            edges = units.setdefault(library_unit(importer), set())
            edges.update(library_unit(t) for t in imported
                         if layer(t) == 1 and library_unit(t) != library_unit(importer))
    cycles, done = [], set()

    def visit(unit: str, path: list[str]) -> None:
        if unit in path:
            cycles.append(path[path.index(unit) :] + [unit])
            return
        if unit in done:
            return
        for nxt in sorted(units.get(unit, ())):
            visit(nxt, [*path, unit])
        done.add(unit)

    for unit in sorted(units):
        visit(unit, [])
    return cycles


def test_no_upward_or_cross_service_imports() -> None:
    graph = import_graph()
    assert len(graph) > 40, "the walk found too few modules: is SOURCES right?"
    assert violations(graph) == []


def test_library_subpackages_form_no_cycle() -> None:
    assert library_cycles(import_graph()) == []


def test_the_checks_catch_what_they_are_for() -> None:
    """The rules themselves, on a made-up graph: each kind of violation is reported."""
    graph = {
        "specdec.model.llama": {"specdec.gateway.scheduler"},  # library -> service
        "specdec.gateway.server": {"specdec.cli.main", "specdec.draft_server.engine"},  # upward, cross-service
        "specdec.cli.main": {"specdec.gateway.server", "specdec.model.llama"},  # fine
        "specdec.cli.demo": {"specdec_bench.config"},  # the command line -> the harness
        "specdec_bench.stack": {"specdec.cli.launcher"},  # fine
        "specdec.serving.engine": {"specdec.wire.items"},
        "specdec.wire.items": {"specdec.serving.engine"},  # a library cycle
    }
    found = violations(graph)
    assert "specdec.model.llama (library) imports specdec.gateway.scheduler (service)" in found
    assert "specdec.gateway.server (service) imports specdec.cli.main (command line)" in found
    assert "service specdec.gateway.server imports another service: specdec.draft_server.engine" in found
    assert "specdec.cli.demo (command line) imports specdec_bench.config (benchmark harness)" in found
    assert len(found) == 4
    assert library_cycles(graph) == [["specdec.serving", "specdec.wire", "specdec.serving"]]
