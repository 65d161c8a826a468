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
from collections.abc import Callable, Iterable
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
    reach = {name: _reachable(edges, name) for name in edges}
    groups = {frozenset(m for m in reach[name] if name in reach[m]) for name in edges if name in reach[name]}
    return sorted(Circle(sorted(group), _shortest_path(edges, min(group), min(group).__eq__)) for group in groups)


def reaching(graph: dict[str, set[str]], source: str, forbidden: Iterable[str]) -> list[str] | None:
    """The shortest chain of imports from `source` to a module within one of `forbidden`, or None."""
    forbidden = tuple(forbidden)
    return _shortest_path(graph, source, lambda module: any(within(module, f) for f in forbidden))


def _reachable(edges: dict[str, set[str]], source: str) -> set[str]:
    """What `source` imports, directly or through others (itself too where a circle leads back)."""
    seen: set[str] = set()
    pending = [source]
    while pending:
        for target in edges.get(pending.pop(), ()):
            if target not in seen:
                seen.add(target)
                pending.append(target)
    return seen


def _shortest_path(edges: dict[str, set[str]], source: str, arrived: Callable[[str], bool]) -> list[str] | None:
    """The shortest chain of arrows from `source` to a module where `arrived` holds (`source` itself
    only back through a circle), breadth first; None when there is none."""
    came_from: dict[str, str] = {}
    frontier = [source]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(edges.get(node, ())):
                if arrived(target):
                    chain = [node]
                    while chain[-1] != source:
                        chain.append(came_from[chain[-1]])
                    return [*reversed(chain), target]
                if target not in came_from and target != source:
                    came_from[target] = node
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
