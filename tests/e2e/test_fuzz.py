"""Every gRPC method of every service fuzzed by hypothesis against `specvox up` (bench/fuzz.py).

Random and malformed messages, raw bytes and request sequences: each call ends OK or with a
clear status and a message, the service stays SERVING after every case, and after each
method every service still answers a valid request. The methods come from the generated
descriptors, so a method added to a proto is fuzzed here with no edit.

SPECVOX_FUZZ_EXAMPLES (default 15) sets the cases per method; in CI (CI=true) the cases are
derandomized, so a run is the same every time. `specvox bench fuzz --cases N` is the large run.
"""

from __future__ import annotations

import os

import pytest

from bench import fuzz

EXAMPLES = int(os.environ.get("SPECVOX_FUZZ_EXAMPLES", "15"))
IN_CI = os.environ.get("CI", "").lower() == "true"
METHODS = fuzz.methods()

pytestmark = pytest.mark.e2e


def grpc_services(stack) -> dict[str, str]:
    """The stack's four gRPC services (not its Valkey, nor the gateway's HTTP surface)."""
    return {name: address for name, address in stack.items() if name not in ("redis", "http")}


@pytest.fixture(scope="module")
def target(stack):
    target = fuzz.Target(grpc_services(stack), stack["redis"])
    yield target
    target.close()


def test_the_methods_cover_every_service_and_match_reflection(stack):
    served = set(grpc_services(stack))
    assert {m.service for m in METHODS} == served, [str(m) for m in METHODS]
    listed = fuzz.check_reflection(grpc_services(stack), METHODS)
    assert all(listed[name] for name in served), listed


def test_the_property_catches_unclear_ends():
    """The check itself: what the fuzzer must flag, it flags."""
    assert fuzz.problem(fuzz.Outcome("UNKNOWN", "Unexpected DecodeError"))
    assert fuzz.problem(fuzz.Outcome("INTERNAL", "tts: internal error: KeyError"))
    assert fuzz.problem(fuzz.Outcome("INVALID_ARGUMENT", ""))
    assert fuzz.problem(fuzz.Outcome("CANCELLED", "Cancelled"))  # a cancel that was not ours
    assert fuzz.problem(fuzz.Outcome("UNAVAILABLE", "Socket closed"))  # a server gone
    assert fuzz.problem(fuzz.Outcome("OK")) is None
    assert fuzz.problem(fuzz.Outcome("CANCELLED", "Locally cancelled", cancelled_by_us=True)) is None
    assert fuzz.problem(fuzz.Outcome("UNAVAILABLE", "llm: redis unreachable at redis://…")) is None


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_fuzzed_method_ends_clearly_and_every_service_serves_after(target, method):
    fuzz.fuzz_method(target, method, EXAMPLES, derandomize=IN_CI, fail_fast=True)
    assert target.all_serve() == dict.fromkeys(target.addresses, "ok")
