"""Generated gRPC code is built by the install, never by an import: a checkout whose services/gen
is missing or older than a .proto says to run `make install`, and writes nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

LOAD_TTS = "from services import protos; print(protos.load('tts')[0].__name__)"


@pytest.fixture
def checkout(tmp_path):
    """services/protos.py, protos/ and a built services/gen, copied: what an import may see."""
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "__init__.py").touch()
    shutil.copy(ROOT / "services" / "protos.py", tmp_path / "services")
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copytree(ROOT / "services" / "gen", tmp_path / "services" / "gen")
    return tmp_path


def load_in(folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD_TTS], cwd=folder, capture_output=True, text=True, timeout=60)


def test_a_built_checkout_loads(checkout):
    done = load_in(checkout)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "services.gen.specvox.tts.v1.tts_pb2"


def test_a_changed_proto_is_refused_and_nothing_is_rebuilt(checkout):
    proto = checkout / "protos" / "specvox" / "tts" / "v1" / "tts.proto"
    generated = checkout / "services" / "gen" / "specvox" / "tts" / "v1" / "tts_pb2.py"
    built = generated.stat().st_mtime
    os.utime(proto, (built + 10, built + 10))
    done = load_in(checkout)
    assert done.returncode != 0
    assert "specvox/tts/v1/tts.proto (changed since built)" in done.stderr
    assert "run `make install` (or `python -m services.protos`)" in done.stderr
    assert generated.stat().st_mtime == built


def test_a_checkout_never_built_says_how_to_build(checkout):
    shutil.rmtree(checkout / "services" / "gen")
    done = load_in(checkout)
    assert done.returncode != 0
    assert "ProtosNotBuiltError" in done.stderr and "specvox/common/v1/common.proto (not built)" in done.stderr
    assert "run `make install`" in done.stderr
    assert not (checkout / "services" / "gen").exists()


def test_each_proto_compiles_with_protos_as_its_only_include_dir(tmp_path):
    """What any client's protoc sees: imports relative to protos/, no path of the Python build."""
    from grpc_tools import protoc

    from services.protos import PROTO_DIR, proto_files

    for proto in proto_files():
        relative = str(proto.relative_to(PROTO_DIR))
        assert protoc.main(["protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={tmp_path / 'set.pb'}",
                            relative]) == 0, relative
        assert "services/gen" not in proto.read_text(), relative


def test_the_build_writes_modules_that_import_each_other_from_services_gen(checkout):
    """A build into a fresh folder, loaded there: the generated imports resolve under services.gen."""
    shutil.rmtree(checkout / "services" / "gen")
    built = subprocess.run([sys.executable, "-c", "from services import protos; protos.build(protos.ROOT)"],
                           cwd=checkout, capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    assert not list((checkout / "services").glob(".gen-*")), "the build left its fresh or old folder"
    gateway = (checkout / "services" / "gen" / "specvox" / "gateway" / "v1" / "gateway_pb2.py").read_text()
    assert "from services.gen.specvox.common.v1 import common_pb2" in gateway
    assert load_in(checkout).returncode == 0
