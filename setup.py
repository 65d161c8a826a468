"""Compiles protos/ into services/gen while building a wheel, so that an installed specvox
(not only an editable checkout) carries its gRPC modules. Everything else is in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        out = Path(self.build_lib)
        protos = sorted((ROOT / "protos").glob("specvox/*/v1/*.proto"))
        from grpc_tools import protoc

        include = Path(protoc.__file__).parent / "_proto"
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-Iservices/gen={ROOT / 'protos'}", f"-I{include}",
             f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}", *map(str, protos)],
            check=True,
        )


setup(cmdclass={"build_py": BuildPyWithProtos})
