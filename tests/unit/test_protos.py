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
