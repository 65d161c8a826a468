"""The generated protobuf and gRPC modules, built from protos/ when missing or stale.

Generated code is never committed or hand-edited: `make protos` (or the first
import here) compiles protos/specvox/*/v1/*.proto into services/gen/.
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


def is_stale() -> bool:
    return any(
        not _generated(p).exists() or _generated(p).stat().st_mtime < p.stat().st_mtime
        for p in proto_files()
    )


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


def load(service: str) -> tuple[ModuleType, ModuleType]:
    """(messages module, gRPC module) of one service, building them first if needed."""
    if is_stale():
        build()
    base = f"services.gen.specvox.{service}.v1.{service}"
    return importlib.import_module(base + "_pb2"), importlib.import_module(base + "_pb2_grpc")


def load_common() -> ModuleType:
    """The messages every service shares (specvox.common.v1): audio, words, cues, stage times."""
    if is_stale():
        build()
    return importlib.import_module("services.gen.specvox.common.v1.common_pb2")


if __name__ == "__main__":
    build()
