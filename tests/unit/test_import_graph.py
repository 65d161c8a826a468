"""The import graph's rules (read from the sources by tests/import_graph.py, lazy imports included):
no circle anywhere, and the arrows point one way: bench -> services -> pipeline. `specvox bench`
reaches bench/ through one importlib dispatch in the command line, which is no import."""

from __future__ import annotations

import pytest

from tests.import_graph import circles, import_graph, imports_of, project_modules, reaching


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_is_read_from_every_module(graph):
    assert {"pipeline.audio", "services.client", "services.settings", "bench.turn"} <= set(graph)
    assert not any(name.startswith("services.gen") for name in project_modules())
    assert {"services.protos", "numpy"} <= graph["services.client"]  # the project's modules by name, others by package


def test_no_modules_import_each_other_in_a_circle(graph):
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(map(str, found))


def breaches(graph: dict[str, set[str]], layer: str, forbidden: tuple[str, ...]) -> list[str]:
    """Each module of `layer` that imports one of `forbidden` itself, with what it imports."""
    return [f"{name} imports {', '.join(sorted(t for t in targets if t.split('.')[0] in forbidden))}"
            for name, targets in sorted(graph.items())
            if name.split(".")[0] == layer and any(t.split(".")[0] in forbidden for t in targets)]


def test_pipeline_imports_nothing_of_services_or_bench(graph):
    found = breaches(graph, "pipeline", ("services", "bench"))
    assert not found, "\n".join(found)


def test_services_import_nothing_of_bench(graph):
    found = breaches(graph, "services", ("bench",))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("server_side", ["services.server", "services.store", "redis"])
def test_the_reference_client_loads_no_server_runtime_store_or_redis(graph, server_side):
    """Not even through what it imports: `import services.client` loads what a client needs."""
    chain = reaching(graph, "services.client", [server_side])
    assert chain is None, " -> ".join(chain or ())


def test_the_reader_counts_lazy_imports_and_leaves_type_checking_ones_out(tmp_path):
    modules = {name: tmp_path / f"{name}.py" for name in ("services.a", "services.b", "services.c")}
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from services.c import C\n"
                      "def later():\n    from services import b\n    import redis.asyncio\n")
    assert imports_of("services.a", source, modules) == {"typing", "services.b", "redis"}


def test_circles_are_found_with_every_module_in_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"b"}, "e": {"a"}}
    assert [(c.members, c.shortest) for c in circles(graph)] == [(["a", "b", "c", "d"], ["a", "b", "c", "a"])]
    assert circles({"a": {"b"}, "b": set()}) == []
