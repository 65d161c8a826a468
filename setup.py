"""Compiles protos/ into services/gen while building a wheel, so that an installed specvox
(not only an editable checkout) carries its gRPC modules. Everything else is in pyproject.toml."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        # services/protos.py's own build (imports relative to protos/, prefixed services.gen.),
        # loaded by path: the wheel is being built, so no specvox is installed to import it from.
        spec = importlib.util.spec_from_file_location("specvox_protos", ROOT / "services" / "protos.py")
        assert spec is not None and spec.loader is not None
        protos = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(protos)
        protos.build(Path(self.build_lib))


setup(cmdclass={"build_py": BuildPyWithProtos})
