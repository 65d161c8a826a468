"""A pytest plugin (`-p tests.without_otel`): OpenTelemetry cannot be imported in this process, as
where the `otel` extra is not installed. tests/e2e/test_metrics.py runs its real turn so."""

from __future__ import annotations

import importlib.abc
import sys


class _NoOtel(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests.without_otel)", name=name)
        return None


sys.meta_path.insert(0, _NoOtel())
for loaded in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
    del sys.modules[loaded]


def pytest_configure(config):
    from services.server import tracing

    assert not tracing.AVAILABLE, "OpenTelemetry was imported before the block"
