"""The generated protobuf and gRPC modules in services/gen, built from protos/ by the install.

Generated code is never committed or hand-edited, and never written by an import: `make install`
(or `python -m services.protos`) compiles protos/specvox/*/v1/*.proto into services/gen/, and a
wheel carries them (setup.py). An import only loads them; missing or older than their .proto,
it says how to build them, rather than four service processes racing to write the same files.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GEN_DIR = ROOT / "services" / "gen"
SERVICES = ("asr", "llm", "tts", "gateway")  # each imports specvox/common/v1/common.proto

log = logging.getLogger(__name__)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("specvox/*/v1/*.proto"))


def _generated(proto: Path) -> Path:
    return GEN_DIR / proto.relative_to(PROTO_DIR).with_name(proto.stem + "_pb2.py")


def build() -> None:
    """Compile every proto; module paths become services.gen.specvox.<svc>.v1."""
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-Iservices/gen={PROTO_DIR}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        f"--pyi_out={ROOT}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR}")
    log.info("compiled %d protos into %s", len(proto_files()), GEN_DIR)


class ProtosNotBuiltError(ImportError):
    """services/gen is missing or older than protos/: the install builds it, an import does not."""


HOW_TO_BUILD = "run `make install` (or `python -m services.protos`) to build them"


def require() -> None:
    """Raise ProtosNotBuiltError, naming the files, when services/gen is missing or stale."""
    missing = [p for p in proto_files() if not _generated(p).exists()]
    stale = [p for p in proto_files() if p not in missing and _generated(p).stat().st_mtime < p.stat().st_mtime]
    if missing or stale:
        what = ", ".join([*(f"{p.relative_to(PROTO_DIR)} (not built)" for p in missing),
                          *(f"{p.relative_to(PROTO_DIR)} (changed since built)" for p in stale)])
        raise ProtosNotBuiltError(f"the generated gRPC code in {GEN_DIR} does not match protos/: {what}; "
                                  + HOW_TO_BUILD)


def _import(module: str) -> ModuleType:
    require()
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:  # an install without protos/ to compare with, and no services/gen
        if e.name and e.name.startswith("services.gen"):
            raise ProtosNotBuiltError(f"{module} is not built; {HOW_TO_BUILD}") from e
        raise


def load(service: str) -> tuple[ModuleType, ModuleType]:
    """(messages module, gRPC module) of one service, as the install built them."""
    base = f"services.gen.specvox.{service}.v1.{service}"
    return _import(base + "_pb2"), _import(base + "_pb2_grpc")


def load_common() -> ModuleType:
    """The messages every service shares (specvox.common.v1): audio, words, cues, stage times."""
    return _import("services.gen.specvox.common.v1.common_pb2")


if __name__ == "__main__":
    build()
