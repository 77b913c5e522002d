"""Structure checks: how the code is laid out and what may import what. Fast, no model loading.

What this guards:

* every installed package (all under the one import name ``card``) imports in a fresh interpreter,
  and none of the repository's folder names (``engine``, ``client``, ...) leaks as a top-level module;
* the seam between the target and the draft side: ``card.engine.target`` never imports
  ``card.engine.draft`` and vice versa, ``card.engine.shared`` imports neither side (nor the in-process
  glue), and each service only reaches the engine side it runs;
* no import cycle among first-party modules (module-level imports; imports inside a function body are
  lazy and may break a cycle on purpose).

The import graph is built statically with ``ast`` from the source folders, mapped to module names with
the ``[tool.setuptools.package-dir]`` table of pyproject.toml. Each checker also runs on a small
synthetic graph that breaks its rule, so a broken checker cannot pass silently.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Module name -> folder, as in pyproject.toml's [tool.setuptools.package-dir] (``card`` itself, the
# generated gRPC code in protos/card, is not parsed: it imports nothing first-party but itself).
SOURCE_DIRS: dict[str, str] = {
    "card.engine": "engine",
    "card.common": "card_common",
    "card.client": "client",
    "card.cache_service": "cache_service",
    "card.draft_service": "draft_service",
    "card.target_service": "target_service",
}

# The packages pyproject.toml installs.
PACKAGES: tuple[str, ...] = (
    "card",
    "card.v1",
    "card.engine",
    "card.engine.shared",
    "card.engine.target",
    "card.engine.draft",
    "card.engine.inprocess",
    "card.engine.loading",
    "card.common",
    "card.client",
    "card.client.bench",
    "card.cache_service",
    "card.draft_service",
    "card.target_service",
)

# Folder names that must never be importable as top-level modules: everything lives under ``card``.
LEAKY_NAMES: frozenset[str] = frozenset(
    {"engine", "client", "card_common", "cache_service", "draft_service", "target_service"}
)

# importer package -> packages it must not import (directly, at any depth of either name).
SEAM_RULES: dict[str, tuple[str, ...]] = {
    "card.engine.target": ("card.engine.draft",),
    "card.engine.draft": ("card.engine.target",),
    "card.engine.shared": ("card.engine.target", "card.engine.draft", "card.engine.inprocess"),
    "card.target_service": ("card.engine.draft", "card.draft_service"),
    "card.draft_service": ("card.engine.target", "card.target_service"),
    "card.cache_service": ("card.engine.target", "card.engine.draft", "card.engine.inprocess"),
}

# importer -> {imported -> line of the first such import}
Graph = dict[str, dict[str, int]]


# --------------------------------------------------------------------------------------------------
# Fresh-interpreter imports


_PROBE = textwrap.dedent(
    """
    import importlib, json, sys, traceback
    modules, leaky = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException:
            failed[name] = traceback.format_exc(limit=-3)
    leaked = sorted({m.partition(".")[0] for m in sys.modules} & leaky)
    print(json.dumps({"failed": failed, "leaked": leaked}))
    """
)


def probe_imports(
    modules: Iterable[str], leaky: Iterable[str], cwd: Path
) -> tuple[dict[str, str], list[str]]:
    """Import ``modules`` in a fresh interpreter started in ``cwd``; return (failed name -> traceback,
    top-level names from ``leaky`` found in sys.modules afterwards)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(modules)), json.dumps(sorted(leaky))],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"import probe crashed:\n{done.stdout}\n{done.stderr}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["failed"], result["leaked"]


def test_every_package_imports_in_a_fresh_interpreter(tmp_path: Path) -> None:
    failed, leaked = probe_imports(PACKAGES, LEAKY_NAMES, cwd=tmp_path)
    assert not failed, "packages that do not import:\n" + "\n".join(f"{k}:\n{v}" for k, v in failed.items())
    assert not leaked, f"generic top-level modules in sys.modules after importing card: {leaked}"


def test_import_probe_detects_failures_and_leaks(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "leaky.py").write_text("import engine\n")
    failed, leaked = probe_imports(["card", "leaky", "card.no_such_module"], LEAKY_NAMES, cwd=tmp_path)
    assert set(failed) == {"card.no_such_module"}
    assert leaked == ["engine"]


# --------------------------------------------------------------------------------------------------
# Static import graph


@dataclass(frozen=True)
class Source:
    text: str
    is_package: bool  # an __init__.py: relative imports resolve against the module itself
    path: str = "<synthetic>"


def first_party_sources(root: Path = ROOT) -> dict[str, Source]:
    """Module name -> source for every .py file under the mapped folders."""
    sources: dict[str, Source] = {}
    for package, folder in SOURCE_DIRS.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join((package, *parts))
            sources[name] = Source(path.read_text(encoding="utf-8"), is_package, str(path.relative_to(root)))
    return sources


def _imports(tree: ast.AST, module_level_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement; with ``module_level_only``, none nested in a function body (class
    bodies and ``if TYPE_CHECKING:`` blocks run at import time, so theirs count)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.attr`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_graph(sources: Mapping[str, Source], *, module_level_only: bool = False) -> Graph:
    """Direct imports between the modules of ``sources``; imports of anything else are dropped."""
    known = set(sources)
    graph: Graph = {}
    for module, source in sources.items():
        edges: dict[str, int] = {}
        package = module if source.is_package else module.rpartition(".")[0]
        tree = ast.parse(source.text, filename=source.path)
        for node in _imports(tree, module_level_only):
            targets: list[str]
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from . import x, from ..a import b
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, node.module] if node.module else up)
                else:
                    base = node.module or ""
                # ``from a.b import c``: c is the submodule a.b.c when there is one, else a name in a.b.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                    for alias in node.names
                ]
            for target in targets:
                resolved = _resolve(target, known)
                if resolved is not None:
                    edges[resolved] = min(edges.get(resolved, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def seam_violations(graph: Graph, rules: Mapping[str, Iterable[str]]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every direct import a rule forbids."""
    bad: list[tuple[str, str, int]] = []
    for importer, edges in sorted(graph.items()):
        for owner, forbidden in rules.items():
            if not _within(importer, owner):
                continue
            for imported, line in sorted(edges.items()):
                if any(_within(imported, f) for f in forbidden):
                    bad.append((importer, imported, line))
    return bad


def import_cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module, and modules that import themselves
    (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, {}):
                    cycles.append(sorted(component))
    return sorted(cycles)


def _describe_cycle(graph: Graph, members: list[str]) -> str:
    inside = set(members)
    edges = [
        f"    {a} -> {b} (line {line})"
        for a in members
        for b, line in sorted(graph[a].items())
        if b in inside
    ]
    return f"  cycle of {len(members)}: {', '.join(members)}\n" + "\n".join(edges)


@pytest.fixture(scope="module")
def sources() -> dict[str, Source]:
    return first_party_sources()


def test_graph_covers_every_package(sources: dict[str, Source]) -> None:
    """The checks below mean nothing if discovery finds nothing: every installed package but the
    generated ``card``/``card.v1`` is parsed, and the graph has first-party edges."""
    assert set(PACKAGES) - {"card", "card.v1"} <= set(sources)
    graph = import_graph(sources)
    assert any(
        _within(b, "card.engine.shared")
        for a in graph
        for b in graph[a]
        if a.startswith("card.engine.target")
    )


def test_target_and_draft_sides_stay_apart(sources: dict[str, Source]) -> None:
    graph = import_graph(sources)
    bad = seam_violations(graph, SEAM_RULES)
    assert not bad, "imports across the target/draft seam (importer -> imported):\n" + "\n".join(
        f"  {a} -> {b}  ({sources[a].path}:{line})" for a, b, line in bad
    )


def test_no_module_level_import_cycles(sources: dict[str, Source]) -> None:
    graph = import_graph(sources, module_level_only=True)
    cycles = import_cycles(graph)
    assert not cycles, "module-level import cycles:\n" + "\n".join(_describe_cycle(graph, c) for c in cycles)


# --------------------------------------------------------------------------------------------------
# Negative controls: the checkers on synthetic graphs that break the rules.


def _synthetic(modules: Mapping[str, str]) -> dict[str, Source]:
    """Sources from ``{name: code}``; a name ending in ``/`` is a package (its __init__)."""
    return {
        name.rstrip("/"): Source(textwrap.dedent(code), is_package=name.endswith("/"))
        for name, code in modules.items()
    }


def test_graph_parses_every_import_form() -> None:
    graph = import_graph(
        _synthetic(
            {
                "card.engine.target/": "from . import generation\n",
                "card.engine.target.generation": """
                    import card.engine.shared.tree
                    from card.engine.shared import stats
                    from card.engine.shared.errors import CardError
                    from .sampling import sample
                    from ..shared import config as cfg
                    import os, torch
                    from typing import TYPE_CHECKING
                    if TYPE_CHECKING:
                        from card.engine.draft.worker import Worker
                    class K:
                        from card.engine.shared import session
                    def lazy():
                        from card.engine.draft import ngram
                """,
                "card.engine.target.sampling": "",
                "card.engine.shared/": "",
                "card.engine.shared.tree": "",
                "card.engine.shared.stats": "",
                "card.engine.shared.errors": "",
                "card.engine.shared.config": "",
                "card.engine.shared.session": "",
                "card.engine.draft/": "",
                "card.engine.draft.worker": "",
                "card.engine.draft.ngram": "",
            }
        )
    )
    eager = {
        "card.engine.shared.tree",
        "card.engine.shared.stats",
        "card.engine.shared.errors",
        "card.engine.target.sampling",
        "card.engine.shared.config",
        "card.engine.draft.worker",
        "card.engine.shared.session",
    }
    assert graph["card.engine.target"] == {"card.engine.target.generation": 1}
    assert set(graph["card.engine.target.generation"]) == eager | {"card.engine.draft.ngram"}


def test_lazy_imports_do_not_count_for_cycles() -> None:
    sources = _synthetic({"card.a": "import card.b\n", "card.b": "def f():\n    import card.a\n"})
    assert import_cycles(import_graph(sources, module_level_only=True)) == []
    assert import_cycles(import_graph(sources)) == [["card.a", "card.b"]]


def test_seam_checker_catches_crossings() -> None:
    graph = import_graph(
        _synthetic(
            {
                "card.engine.target.verify": "from card.engine.draft.drafter import Drafter\n",
                "card.engine.draft.worker": "def f():\n    import card.engine.target.scheduler\n",
                "card.engine.draft.drafter": "from card.engine.shared.tree import Tree\n",
                "card.engine.shared.tree": "from card.engine.inprocess.runner import run\n",
                "card.engine.target.scheduler": "",
                "card.engine.inprocess.runner": "import card.engine.target.scheduler, card.engine.draft\n",
                "card.target_service.server": "from card.draft_service import link\n",
                "card.draft_service.link": "",
                "card.cache_service.store": "from card.engine.shared.tree import Tree\n",
            }
        )
    )
    assert seam_violations(graph, SEAM_RULES) == [
        ("card.engine.draft.worker", "card.engine.target.scheduler", 2),
        ("card.engine.shared.tree", "card.engine.inprocess.runner", 1),
        ("card.engine.target.verify", "card.engine.draft.drafter", 1),
        ("card.target_service.server", "card.draft_service.link", 1),
    ]


def test_cycle_checker_catches_cycles_and_self_imports() -> None:
    graph: Graph = {
        "a": {"b": 1},
        "b": {"c": 1},
        "c": {"a": 1, "d": 1},
        "d": {},
        "e": {"e": 1},
        "f": {"d": 1},
    }
    assert import_cycles(graph) == [["a", "b", "c"], ["e"]]
    assert import_cycles({"a": {"b": 1}, "b": {}}) == []
