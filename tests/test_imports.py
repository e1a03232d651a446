"""No import circles: the imports of the repository's non-test code, at module level or inside functions, form no cycle.

Every `.py` file outside tests/ and hidden directories is a node, found by walking the repository (new
packages are picked up as they come); its name is its dotted path (`flows.runtime`, `bench.common`).
Imports under `if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import REPO_ROOT

SKIPPED_DIRECTORIES = {"tests", "build", "node_modules", "__pycache__"}  # And every hidden one (.venv, .git).


def source_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        directories = path.relative_to(root).parts[:-1]
        if not any(
            part in SKIPPED_DIRECTORIES or part.startswith(".") or part.endswith(".egg-info") for part in directories
        ):
            yield path


def dotted(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def executed_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of the tree, functions' bodies included, but not the bodies of `if TYPE_CHECKING:`."""
    nodes = [tree]
    while nodes:
        node = nodes.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.extend(node.orelse)
        else:
            nodes.extend(ast.iter_child_nodes(node))


class ImportGraph:
    """Module name -> the repository modules it imports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = {dotted(root, path): path for path in source_files(root)}
        self.edges = {name: self._imports(name, path) for name, path in self.paths.items()}

    def _anchor(self, path: Path) -> str:
        """Where the file's absolute imports start: the root for package code; for a script, the nearest
        directory that is no package (Python puts the script's directory first on sys.path)."""
        directory = path.parent
        while directory != self.root and (directory / "__init__.py").is_file():
            directory = directory.parent
        return "" if directory == self.root else ".".join(directory.relative_to(self.root).parts)

    def _resolve(self, name: str, anchor: str = "") -> str | None:
        """The repository module that importing `name` loads (its longest known prefix), None for another's."""
        for candidate, shortest in ((f"{anchor}.{name}", anchor.count(".") + 2), (name, 1)) if anchor else ((name, 1),):
            parts = candidate.split(".")
            for end in range(len(parts), shortest - 1, -1):
                if ".".join(parts[:end]) in self.paths:
                    return ".".join(parts[:end])
        return None

    def _imports(self, importer: str, path: Path) -> set[str]:
        anchor, targets = self._anchor(path), set()
        for node in executed_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets |= {self._resolve(alias.name, anchor) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                if node.level:  # Relative: a full name inside the importer's own package.
                    base = self._package(importer, path, node.level, node.module)
                    targets |= {self._resolve(f"{base}.{alias.name}") for alias in node.names}
                else:  # `from a.b import c`: the module a.b.c when there is one, else a.b.
                    targets |= {self._resolve(f"{node.module}.{alias.name}", anchor) for alias in node.names}
        return {target for target in targets if target and target != importer}

    @staticmethod
    def _package(importer: str, path: Path, level: int, module: str | None) -> str:
        """The package a relative import names: `level` dots up from the importer's own package."""
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for _ in range(level - 1):
            package = package.rpartition(".")[0]
        return ".".join(part for part in (package, module) if part)

    def cycles(self) -> list[list[str]]:
        """One cycle, as a path back to its start, per strongly connected group of modules."""
        return [self._cycle_in(group) for group in strongly_connected(self.edges) if len(group) > 1]

    def _cycle_in(self, group: set[str]) -> list[str]:
        start = min(group)
        previous, queue = {start: start}, deque([start])
        while queue:  # The shortest way from `start` back to itself, inside the group.
            name = queue.popleft()
            for target in sorted(self.edges[name] & group):
                if target == start:
                    path = [name]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target not in previous:
                    previous[target] = name
                    queue.append(target)
        raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit on deep graphs)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            name, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[name])
                if low[name] == index[name]:
                    group, member = set(), None
                    while member != name:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                    groups.append(group)
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(edges.get(target, ())))))
            elif target in on_stack:
                low[name] = min(low[name], index[target])
    return groups


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(REPO_ROOT)


@pytest.mark.slow
def test_the_repository_has_no_import_cycle(graph):
    cycles = [" -> ".join(cycle) for cycle in graph.cycles()]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_graph_sees_every_kind_of_import(graph):
    assert {"cifar.summary", "flows.runtime", "tasks.artifacts"} <= set(graph.edges)
    assert "flows.runtime" in graph.edges["flows.pipeline"]  # Module level.
    assert "cifar.data.snapshots" in graph.edges["cifar.retraining"]
    assert "bench.common" in graph.edges["bench.convert"]  # A script's sibling, by its bare name.
    assert not any(name.startswith("tests.") for name in graph.edges)


def test_a_cycle_through_a_function_level_or_relative_import_is_named(tmp_path):
    package = tmp_path / "house"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def later():\n    from house.c import value\n")
    (package / "c.py").write_text("import house.a\nvalue = 1\n")
    (package / "d.py").write_text("from .a import b\n")  # Into the cycle, not part of it.
    (package / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from house.f import F\n")
    (package / "f.py").write_text("from house.e import TYPE_CHECKING\n")  # Only a type checker's circle.
    assert ImportGraph(tmp_path).cycles() == [["house.a", "house.b", "house.c", "house.a"]]
