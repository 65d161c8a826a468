"""The nvidia-riva-client wheel whose generated code services/riva builds on: it imports here without a
warning, pyproject's floors for grpcio and protobuf are at least what that code demands (its own metadata
asks for less), and every RPC of Riva's two speech services has a servicer method of ours."""

from __future__ import annotations

import importlib
import re
import tomllib
import warnings
from pathlib import Path

import grpc
from google import protobuf
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
RIVA_MODULES = ("riva_asr_pb2", "riva_asr_pb2_grpc", "riva_tts_pb2", "riva_tts_pb2_grpc", "riva_audio_pb2")


def floors() -> dict[str, Version]:
    """The lowest version pyproject's main dependencies allow, by package (the highest of its `>=` floors)."""
    found: dict[str, Version] = {}
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator in (">=", "=="):
                found[requirement.name] = max(found.get(requirement.name, Version("0")), Version(spec.version))
    return found


def generated_for(module: str, pattern: str) -> Version:
    """The version a generated module says it was made for (its source, as protoc wrote it)."""
    spec = importlib.util.find_spec(f"riva.client.proto.{module}")
    assert spec is not None and spec.origin is not None
    return Version(re.search(pattern, Path(spec.origin).read_text())[1])


def test_the_generated_code_imports_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in RIVA_MODULES:
            importlib.import_module(f"riva.client.proto.{name}")


def test_pyproject_floors_meet_what_the_generated_code_demands():
    grpc_needs = generated_for("riva_tts_pb2_grpc", r"GRPC_GENERATED_VERSION = '([\d.]+)'")
    protobuf_needs = generated_for("riva_tts_pb2", r"# Protobuf Python Version: ([\d.]+)")
    assert grpc_needs >= Version("1.81") and protobuf_needs >= Version("6.33.5")  # as the issue found them
    ours = floors()
    assert ours["grpcio"] >= grpc_needs and ours["protobuf"] >= protobuf_needs, ours
    assert Version(grpc.__version__) >= grpc_needs and Version(protobuf.__version__) >= protobuf_needs
    assert "nvidia-riva-client" in ours


def test_every_riva_rpc_has_a_method_of_ours():
    from riva.client.proto import riva_asr_pb2, riva_tts_pb2

    from services.riva.asr import RivaAsrServicer
    from services.riva.tts import RivaTtsServicer

    for servicer, proto, service in ((RivaAsrServicer, riva_asr_pb2, "RivaSpeechRecognition"),
                                     (RivaTtsServicer, riva_tts_pb2, "RivaSpeechSynthesis")):
        base = servicer.__mro__[1]  # the wheel's, whose methods answer UNIMPLEMENTED
        for method in proto.DESCRIPTOR.services_by_name[service].methods:
            assert getattr(servicer, method.name) is not getattr(base, method.name), f"{service}.{method.name}"
