"""The project's import graph as its sources state it, read from their ASTs without importing them.

Every `import` that runs counts, the ones inside functions too: a lazy import is still an arrow,
and the usual way a circle hides. Imports under `if TYPE_CHECKING:` never run and are left out
(annotations' types, the usual way to type against a one-way arrow). The modules are pipeline/,
services/ (less the generated services/gen) and bench/; an import of anything else is kept by its
top-level name (`redis`, `grpc`). tests/unit/test_import_graph.py holds the rules;
`python -m tests.import_graph PREFIX...` prints the arrows among the modules under those prefixes.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "services", "bench")
GENERATED = "services.gen"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the three packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            if not within(name, GENERATED):
                modules[name] = path
    return modules


def within(name: str, prefix: str) -> bool:
    """`name` is `prefix` or below it: services.store.keys is within services.store, not within services.st."""
    return name == prefix or name.startswith(prefix + ".")


def _known(name: str, modules: dict[str, Path]) -> str:
    """The project module `name` runs (its longest known prefix), or its top-level name if it is not ours."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return parts[0]


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _running_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of `tree` but the bodies of `if TYPE_CHECKING:` (their `else:` runs)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        if _type_checking_only(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """What module `name` imports anywhere in its source: project modules by full name, others by top-level name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _running_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {_known(alias.name, modules) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from services import cli` imports the module services.cli
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else _known(base, modules))
    found.discard(name)
    return {f for f in found if not within(f, GENERATED)}


def import_graph() -> dict[str, set[str]]:
    """Module -> everything it imports (see `imports_of`)."""
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def project_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with only the arrows between the project's own modules."""
    return {name: {t for t in targets if t in graph} for name, targets in graph.items()}


class Circle(NamedTuple):
    """Modules that reach each other through imports (a strongly connected component), and the
    shortest circle through the first of them, as [a, b, ..., a]."""

    members: list[str]
    shortest: list[str]

    def __str__(self) -> str:
        others = sorted(set(self.members) - set(self.shortest))
        return " -> ".join(self.shortest) + (f" (and {', '.join(others)} in circles with them)" if others else "")


def circles(graph: dict[str, set[str]]) -> list[Circle]:
    """Every group of the project's modules that import each other; none when the graph has no cycle."""
    edges = project_edges(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(start: str) -> None:  # Tarjan's algorithm, iterative: no recursion limit on long chains
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(edges[target]))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])

    for name in sorted(edges):
        if name not in index:
            connect(name)
    return sorted(Circle(sorted(c), _shortest_circle(edges, c)) for c in components if len(c) > 1)


def _shortest_circle(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first inside the component, back to `start`
        following = []
        for node in frontier:
            for target in sorted(edges[node] & component):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(component)} is no cycle")


def reaching(graph: dict[str, set[str]], source: str, forbidden: Iterable[str]) -> list[str] | None:
    """The shortest chain of imports from `source` to a module within one of `forbidden`, or None."""
    forbidden = tuple(forbidden)
    came_from = {source: ""}
    frontier = [source]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target in came_from:
                    continue
                came_from[target] = node
                if any(within(target, f) for f in forbidden):
                    chain = [target]
                    while chain[-1] != source:
                        chain.append(came_from[chain[-1]])
                    return chain[::-1]
                following.append(target)
        frontier = following
    return None


def main(prefixes: list[str]) -> None:
    edges = project_edges(import_graph())
    for name in sorted(edges):
        if any(within(name, p) for p in prefixes):
            targets = sorted(t for t in edges[name] if any(within(t, p) for p in prefixes))
            print(f"{name} -> {', '.join(targets) if targets else '(none of these)'}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(PACKAGES))
