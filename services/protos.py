"""The generated protobuf and gRPC modules in services/gen, built from protos/ by the install.

Generated code is never committed or hand-edited, and never written by an import: `make install`
(or `python -m services.protos`) compiles protos/specvox/*/v1/*.proto into services/gen/, and a
wheel carries them (setup.py). An import only loads them; missing or older than their .proto,
it says how to build them, rather than four service processes racing to write the same files.

The protos import each other relative to protos/ ("specvox/common/v1/common.proto"), so that a
client in any language compiles them as shipped with `protoc -Iprotos`. protoc's Python plugin
turns that import into `from specvox.common.v1 import common_pb2` and has no option to put a
package in front (Go's plugin has go_package), so the build prefixes `services.gen.` to those
imports. The other way round (an include mapping
`-Iservices/gen=protos`, as before) would give the Python build the right module names but make
the protos' import paths a path of the Python build that no other client can resolve.
The build writes into a fresh folder and swaps it in (two renames), so that services and tests
running from this checkout never import a half-written services/gen.
"""

from __future__ import annotations

import importlib
import logging
import re
import shutil
import tempfile
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


# The generated imports of other specvox protos (`from specvox.common.v1 import common_pb2 as ...`
# in _pb2.py, .pyi and _pb2_grpc.py), which become imports of services.gen.specvox.
PROTO_IMPORT = re.compile(r"^from specvox\.", re.MULTILINE)


def build(out_root: Path = ROOT) -> None:
    """Compile every proto into out_root/services/gen, as modules services.gen.specvox.<svc>.v1."""
    from grpc_tools import protoc

    gen = out_root / "services" / "gen"
    gen.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=".gen-", dir=gen.parent))
    try:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={fresh}",
            f"--grpc_python_out={fresh}",
            f"--pyi_out={fresh}",
            *[str(p) for p in proto_files()],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR}")
        for module in [*fresh.rglob("*.py"), *fresh.rglob("*.pyi")]:
            module.write_text(PROTO_IMPORT.sub("from services.gen.specvox.", module.read_text()))
        fresh.chmod(0o755)  # mkdtemp's 0700 would hide the code from other users of an install
        old = gen.with_name(fresh.name + "-old")
        if gen.exists():
            gen.rename(old)
        fresh.rename(gen)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    log.info("compiled %d protos into %s", len(proto_files()), gen)


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
