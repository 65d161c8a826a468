"""The native gRPC API from another language: a Node.js client (@grpc/grpc-js and
@grpc/proto-loader from npm, tests/clients/node) loads protos/ as shipped, with no include
mapping, and converses with the real stack; bad input from it gets a clear status and the
gateway serves the next call.

The client runs as a subprocess and prints JSON. Without node (>= 18) or its packages
(`make node-client`, run by `make test`) these tests skip locally; in CI (CI=true) they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import jiwer
import pytest

from pipeline.asr_stream import normalised_text
from pipeline.audio import float_to_pcm16
from services.protos import load
from tests.conftest import ROOT

NODE_DIR = ROOT / "tests" / "clients" / "node"
PROTOS = ROOT / "protos"
QUESTION = "What is the capital of France?"
RATE = 16_000
NODE_TIMEOUT_S = 300

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def node() -> str:
    node = shutil.which("node")
    if node is None:
        problem = "node is not on PATH (Node.js >= 18)"
    elif (major := int(subprocess.run([node, "--version"], capture_output=True, text=True,
                                      check=True).stdout.strip().lstrip("v").split(".")[0])) < 18:
        problem = f"node {major} is older than 18"
    elif not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        problem = f"{NODE_DIR.relative_to(ROOT)} has no node_modules (run `make node-client`)"
    else:
        return node
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{problem}; CI must install Node.js and run `make node-client` (make test does)")
    pytest.skip(problem)


def run_node(node: str, *args: str) -> dict:
    done = subprocess.run([node, "converse.mjs", *args, "--protos", str(PROTOS)], cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=NODE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_node_loads_every_proto_as_shipped(node):
    """proto-loader with protos/ as its only include dir sees the services the Python build serves."""
    loaded = run_node(node, "services")
    assert loaded["files"] == sorted(str(p.relative_to(PROTOS)) for p in PROTOS.glob("specvox/*/v1/*.proto"))
    served = {}
    for name in ("asr", "llm", "tts", "gateway"):
        for service in load(name)[0].DESCRIPTOR.services_by_name.values():
            served[service.full_name] = sorted(m.name for m in service.methods)
    assert loaded["services"] == served


def test_node_converses(node, stack, speech, tmp_path):
    pcm = tmp_path / "question.pcm"
    pcm.write_bytes(float_to_pcm16(speech(QUESTION, RATE)))
    got = run_node(node, "converse", "--address", stack["gateway"], "--pcm", str(pcm), "--rate", str(RATE))

    assert got["status"]["code_name"] == "OK", got["status"]
    assert got["ready"] and got["session_id"]
    assert len(got["final_transcripts"]) == 1, got["final_transcripts"]
    transcript = got["final_transcripts"][0]
    assert jiwer.wer(normalised_text(QUESTION), normalised_text(transcript)) < 0.10, transcript
    assert got["reply_text"].strip(), "the avatar said nothing"

    [rate] = got["audio_sample_rates_hz"]
    audio_s = got["audio_bytes"] / 2 / rate
    words = len(got["reply_text"].split())
    assert 0.15 * words <= audio_s <= 1.5 * words + 1.0, (audio_s, got["reply_text"])

    [report] = got["reports"]
    assert report["finish_reason"] in ("eos", "length"), report
    assert report["transcript"] == transcript
    assert normalised_text(report["reply_text"]) == normalised_text(got["reply_text"])
    assert report["first_audio_sent_unix_ms"] >= report["speech_end_unix_ms"] > 0


def test_node_bad_input_is_refused_then_served(node, stack):
    got = run_node(node, "malformed", "--address", stack["gateway"])
    expected = {
        "audio_first": ("INVALID_ARGUMENT", "first message"),
        "unknown_session": ("NOT_FOUND", "unknown session"),
        "sample_width_1": ("INVALID_ARGUMENT", "sample width"),
        "oversize_audio": ("RESOURCE_EXHAUSTED", "larger than max"),
    }
    for case, (code, fragment) in expected.items():
        status = got["refused"][case]
        assert status["code_name"] == code and fragment in status["details"], (case, status)
    after = got["after"]
    assert after["status"]["code_name"] == "OK", after["status"]
    assert after["event_kinds"] == ["ready"]  # silence: nothing to answer, the stream ends cleanly
