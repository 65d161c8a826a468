"""`specvox bench fuzz`: every gRPC method of every specvox service, fed random, malformed and raw requests.

The methods come from the generated descriptors (every `specvox.*.v1` service in services/gen),
so a method added to a proto is fuzzed with nothing else to edit; each server's reflection must
list the same services (`check_reflection`). hypothesis draws each method's cases from its
request descriptor:

- ``message``: a request with any subset of its fields set: every field type, one member of each
  oneof or none, repeated fields empty, short or very long, empty and huge strings and bytes,
  NaN, infinities, negative and huge integers, unknown enum values; the fields the services look
  up (session_id, turn_id, voice, drafter, …) take a real value now and then (`hints`);
- ``guided``: the same, with those fields always real, so that a case gets past the lookups into
  the stage's own code (a reply decoded, a synthesis, a conversation);
- ``bytes``: raw bytes as the request (random, or a valid request cut short with junk after it),
  sent through a generic channel with identity serializers: mostly no valid protobuf;
- ``sequence`` (client-streaming methods): messages and raw bytes in any order (the config missing,
  twice, audio before it, empty chunks), waits for the server's first answer, an early close or a
  cancel. A server-streaming call may also be cancelled after its first answers.

The property: every call ends OK or with a clear status (CLEAR) and a non-empty message, never
UNKNOWN or INTERNAL; CANCELLED only after our own cancel; UNAVAILABLE only naming Redis (a server
that died reads UNAVAILABLE too); the method's service answers its health check SERVING after every
case; and after each method every service answers a valid request (PROBES). tests/e2e/test_fuzz.py
asserts it at a small size; `specvox bench fuzz --cases N` counts it at size N.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib
import json
import math
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from services import protos

CLEAR = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAVAILABLE",
                   "DEADLINE_EXCEEDED"})
CALL_TIMEOUT_S = 8.0  # a valid case (a reply, a synthesis) runs into this deadline: DEADLINE_EXCEEDED is clear
HEALTH_TIMEOUT_S = 60.0  # a health check waits this long (the server may still be busy with the case)
PROBE_TIMEOUT_S = 180.0  # a valid request waits behind what the fuzzed calls left on a model thread
WAIT_S = 10.0  # a sequence's "wait for the server's first answer" gives up after this
MAX_DEPTH = 3  # nested messages deeper than this stay unset
REPEAT_LIMIT_BYTES = 8 * 1024 * 1024  # a long repeated field holds at most about this much
CLIENT_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# Strings near and past the limits the services state (asr's prompt 400 characters, the system
# prompt 8,000, tts's text 100,000) and past the 4 MiB message limit.
HUGE_LENGTHS = (401, 8_001, 100_001, 1_000_000, 4 * 1024 * 1024 + 1)
HUGE_UNITS = ("x", "word ", "Hi. ", "é", "😀", "\x00", "\n")
EDGE_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 1e-30, 1e30, 3.4e38, 1.7e308, 5e-324)
INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


# ---- the methods ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Method:
    service: str  # the stack's name for the server that serves it: "tts"
    descriptor: MethodDescriptor

    @property
    def name(self) -> str:
        return f"{self.descriptor.containing_service.full_name}/{self.descriptor.name}"

    @property
    def path(self) -> str:
        return "/" + self.name

    @property
    def service_full_name(self) -> str:
        return self.descriptor.containing_service.full_name

    @property
    def client_streaming(self) -> bool:
        return self.descriptor.client_streaming

    @property
    def server_streaming(self) -> bool:
        return self.descriptor.server_streaming

    def __str__(self) -> str:
        return f"{self.descriptor.containing_service.name}.{self.descriptor.name}"


def methods() -> list[Method]:
    """Every method of every service in the protos, in proto order."""
    found = []
    for proto in protos.proto_files():
        rel = proto.relative_to(protos.PROTO_DIR).with_suffix("")
        module = importlib.import_module("services.gen." + ".".join(rel.parts) + "_pb2")
        for service in module.DESCRIPTOR.services_by_name.values():
            name = service.full_name.split(".")[1]  # specvox.<name>.v1.<Service>
            found += [Method(name, m) for m in service.methods]
    return found


def check_reflection(addresses: dict[str, str], enumerated: list[Method]) -> dict[str, list[str]]:
    """Each server's specvox services by its own reflection; AssertionError where they differ from the
    enumerated ones (a server that serves a method the protos lack, or misses one)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    listed: dict[str, list[str]] = {}
    for name, address in addresses.items():
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=30)
            listed[name] = sorted(s.name for r in replies for s in r.list_services_response.service
                                  if s.name.startswith("specvox."))
        expected = sorted({m.service_full_name for m in enumerated if m.service == name})
        assert listed[name] == expected, f"{name} at {address} reflects {listed[name]}, the protos say {expected}"
    return listed


# ---- strategies from descriptors -------------------------------------------------------------

def _huge_text() -> st.SearchStrategy[str]:
    return st.tuples(st.sampled_from(HUGE_UNITS), st.sampled_from(HUGE_LENGTHS)).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[: t[1]])


def _audio_like() -> st.SearchStrategy[bytes]:
    """Bytes an audio field may meet: WAV headers (whole, cut short), silence, odd lengths, noise."""
    from pipeline.audio import wav_bytes

    wav = wav_bytes(b"\x00\x01" * 1600, 16_000, 1)
    return st.one_of(
        st.sampled_from([wav, wav[:4], wav[:12], wav[:44], b"RIFF\xff\xff\xff\xffWAVE", b"\x00" * 3200,
                         b"\x00" * 3201, b"\xff\x7f" * 1600]),
        st.tuples(st.randoms(use_true_random=True), st.sampled_from([320, 3_201, 32_000, 320_000])).map(
            lambda t: t[0].randbytes(t[1])),
    )


def text_strategy() -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.sampled_from([" ", "\n\t ", "\x00", "...", "?", "Hi.", "-1", "NaN"]),
                     st.text(max_size=40), _huge_text())


def bytes_strategy() -> st.SearchStrategy[bytes]:
    return st.one_of(st.just(b""), st.binary(max_size=64), _audio_like(),
                     st.sampled_from(HUGE_LENGTHS).map(lambda n: b"\x00" * n))


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, hi // 2, -1 if lo < 0 else 2})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, -1000), 1000))


def _enum(f: FieldDescriptor) -> st.SearchStrategy[int]:
    known = [v.number for v in f.enum_type.values]
    return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))  # proto3 enums are open


def scalar_strategy(f: FieldDescriptor) -> st.SearchStrategy:
    t = f.cpp_type
    if t in INT_RANGES:
        return _ints(*INT_RANGES[t])
    if t == FieldDescriptor.CPPTYPE_DOUBLE:
        return st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())
    if t == FieldDescriptor.CPPTYPE_FLOAT:
        return st.one_of(st.sampled_from(EDGE_FLOATS[:-3]), st.floats(width=32))
    if t == FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.CPPTYPE_ENUM:
        return _enum(f)
    if f.type == FieldDescriptor.TYPE_BYTES:
        return bytes_strategy()
    return text_strategy()


def _repeated(f: FieldDescriptor) -> bool:
    return f.is_repeated if hasattr(f, "is_repeated") else f.label == FieldDescriptor.LABEL_REPEATED  # protobuf < 6


def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _single(f: FieldDescriptor, hints: dict, depth: int, guided: bool) -> st.SearchStrategy:
    if f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        return message_strategy(f.message_type, hints, depth + 1, guided=guided)
    base = scalar_strategy(f)
    known = hints.get(f.name)
    if not known:
        return base
    return st.sampled_from(known) if guided else st.booleans().flatmap(
        lambda real: st.sampled_from(known) if real else base)


def value_strategy(f: FieldDescriptor, hints: dict, depth: int, guided: bool = False) -> st.SearchStrategy:
    """A value for the field as set on a message: a list for a repeated field, a dict for a map."""
    if _is_map(f):
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return st.dictionaries(_single(key, hints, depth, guided), _single(value, hints, depth, guided), max_size=4)
    one = _single(f, hints, depth, guided)
    if _repeated(f):
        many = st.tuples(one, st.sampled_from([200, 20_000])).map(lambda t: _repeat(*t))
        return st.one_of(st.lists(one, max_size=4), many)
    return one


def _repeat(value, n: int) -> list:
    """`n` copies, fewer where they would pass REPEAT_LIMIT_BYTES: 20,000 copies of a 4 MiB string
    are 80 GB once protobuf copies them (the fuzzer met the OOM killer so)."""
    size = len(value) if isinstance(value, str | bytes) else value.ByteSize() if hasattr(value, "ByteSize") else 8
    return [value] * max(1, min(n, REPEAT_LIMIT_BYTES // max(1, size)))


def _set(message, f: FieldDescriptor, value) -> None:
    target = getattr(message, f.name)
    try:
        if _is_map(f):
            for k, v in value.items():
                if f.message_type.fields_by_name["value"].cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif _repeated(f):
            target.extend(value)
        elif f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, f.name, value)
    except (ValueError, TypeError):
        pass  # a value this field's type cannot hold at all (protobuf refuses it on our side)


def message_strategy(desc: Descriptor, hints: dict, depth: int = 0, opening: FieldDescriptor | None = None,
                     guided: bool = False) -> st.SearchStrategy:
    """Messages of type `desc` with any subset of fields set; `opening`: that oneof member always set;
    `guided`: the fields `hints` names always set to a real value (the rest as random as ever)."""
    cls = message_factory.GetMessageClass(desc)
    if depth > MAX_DEPTH:
        return st.just(cls())

    def value(f: FieldDescriptor) -> st.SearchStrategy:
        strategy = value_strategy(f, hints, depth, guided)
        looked_up = f.name in hints and not _repeated(f)  # set more often than not; when guided, always
        return strategy if looked_up and guided else st.one_of(st.none(), strategy)

    plain = [f for f in desc.fields if f.containing_oneof is None]
    values = st.fixed_dictionaries({f.name: value(f) for f in plain})
    choices = {}
    for oneof in desc.oneofs:
        members = [opening] if opening is not None and opening.containing_oneof is oneof else list(oneof.fields)
        options = [st.tuples(st.just(f), value_strategy(f, hints, depth, guided)) for f in members]
        choices[oneof.name] = st.one_of(options) if opening in members else st.one_of(st.none(), *options)

    def build(plain_values: dict, chosen: dict):
        message = cls()
        for f in plain:
            if plain_values[f.name] is not None:
                _set(message, f, plain_values[f.name])
        for pick in chosen.values():
            if pick is not None:
                _set(message, *pick)
        return message

    return st.builds(build, values, st.fixed_dictionaries(choices))


def opening_member(desc: Descriptor) -> FieldDescriptor | None:
    """The member a stream's first message must carry (asr's config, the gateway's start): the
    message-typed first member of the request's oneof, where it has one."""
    for oneof in desc.oneofs:
        first = min(oneof.fields, key=lambda f: f.number)
        if first.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            return first
    return None


# ---- cases -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    kind: str  # "message", "guided", "bytes" or "sequence"
    steps: tuple  # ("send", bytes) | ("wait",) | ("cancel",); one send for a unary request
    cancel_after: int | None = None  # server streaming: cancel once this many answers came (0: at once)

    def describe(self, limit: int = 160) -> str:
        def one(step) -> str:
            if step[0] != "send":
                return step[0]
            raw = step[1]
            return f"send {len(raw)} B {raw[:48]!r}{'…' if len(raw) > 48 else ''}"

        text = f"{self.kind}: " + ", ".join(one(s) for s in self.steps) if self.steps else f"{self.kind}: nothing sent"
        text += f", cancel after {self.cancel_after} answers" if self.cancel_after is not None else ""
        return text if len(text) <= limit else text[: limit - 1] + "…"

    def __repr__(self) -> str:  # what hypothesis prints of a failing case: not megabytes of payload
        return f"Case({self.describe(600)!r})"


def _corrupted(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A valid serialization cut short with junk after it: protobuf that is almost right."""
    return st.tuples(valid, st.integers(0, 64), st.binary(min_size=1, max_size=8)).map(
        lambda t: t[0][: max(0, len(t[0]) - t[1])] + t[2])


def case_strategy(method: Method, hints: dict) -> st.SearchStrategy[Case]:
    """A method's cases: random, guided and raw requests; for a client-streaming method, sequences."""
    request = method.descriptor.input_type

    def serialized(**kw) -> st.SearchStrategy[bytes]:
        return message_strategy(request, hints, **kw).map(lambda m: m.SerializeToString())

    random_, guided = serialized(), serialized(guided=True)
    raw = st.one_of(st.binary(max_size=256), _corrupted(random_))
    cancel = st.one_of(st.none(), st.sampled_from([0, 1, 2])) if method.server_streaming else st.none()
    if not method.client_streaming:
        return st.one_of(
            st.builds(lambda b, c: Case("message", (("send", b),), c), random_, cancel),
            st.builds(lambda b, c: Case("guided", (("send", b),), c), guided, cancel),
            st.builds(lambda b, c: Case("bytes", (("send", b),), c), raw, cancel),
        )
    opening = opening_member(request)
    first = (st.one_of(st.none(), serialized(opening=opening), serialized(opening=opening, guided=True))
             if opening is not None else st.none())
    step = st.one_of(random_.map(lambda b: ("send", b)), guided.map(lambda b: ("send", b)),
                     raw.map(lambda b: ("send", b)), st.just(("wait",)), st.just(("cancel",)))
    return st.builds(
        lambda f, rest, c: Case("sequence", ((("send", f),) if f is not None else ()) + tuple(rest), c),
        first, st.lists(step, max_size=6), cancel)


# ---- calls -----------------------------------------------------------------------------------

@dataclass
class Outcome:
    code: str  # "OK" or a status name
    details: str = ""
    answers: int = 0
    cancelled_by_us: bool = False


def problem(outcome: Outcome) -> str | None:
    """What is wrong with how a call ended; None: a clear end."""
    code, details = outcome.code, outcome.details or ""
    if code == "OK" or (code == "CANCELLED" and outcome.cancelled_by_us):
        return None
    if code not in CLEAR:
        return f"unclear status {code}: {details!r}"
    if not details.strip():
        return f"{code} with an empty message"
    if code == "UNAVAILABLE" and "redis" not in details.lower():
        return f"UNAVAILABLE not naming Redis (a server gone?): {details!r}"
    if "metadata size exceeds" in details:
        return f"the status' message overflowed the client's metadata limit, its own status lost: {details!r}"
    return None


class _Sequence:
    """The request side of a client-streaming call, played from a case's steps in grpc's sender thread."""

    def __init__(self, steps: tuple) -> None:
        self.steps = steps
        self.answered = threading.Event()
        self.created = threading.Event()
        self.call = None
        self.cancelled = False

    def requests(self) -> Iterator[bytes]:
        for step in self.steps:
            if step[0] == "send":
                yield step[1]
            elif step[0] == "wait":
                self.answered.wait(WAIT_S)
            else:
                self.created.wait(WAIT_S)
                self.cancelled = True
                if self.call is not None:
                    self.call.cancel()
                return


def call(channel: grpc.Channel, method: Method, case: Case, timeout_s: float = CALL_TIMEOUT_S) -> Outcome:
    """Play one case on the method through identity serializers; how the call ended."""
    kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
    multicallable = getattr(channel, kind)(method.path, request_serializer=None, response_deserializer=None)
    if not method.server_streaming:
        if method.client_streaming:  # no such method in specvox today
            sequence = _Sequence(case.steps)
            try:
                multicallable(sequence.requests(), timeout=timeout_s)
                return Outcome("OK", answers=1, cancelled_by_us=sequence.cancelled)
            except grpc.RpcError as e:
                return Outcome(e.code().name, e.details() or "", 0, sequence.cancelled)
        try:
            multicallable(case.steps[0][1], timeout=timeout_s)
            return Outcome("OK", answers=1)
        except grpc.RpcError as e:
            return Outcome(e.code().name, e.details() or "")
    sequence = _Sequence(case.steps)
    answers = 0
    started = multicallable(sequence.requests() if method.client_streaming else case.steps[0][1], timeout=timeout_s)
    sequence.call = started
    sequence.created.set()
    try:
        if case.cancel_after == 0:
            sequence.cancelled = True
            started.cancel()
        for _ in started:
            answers += 1
            sequence.answered.set()
            if case.cancel_after is not None and answers >= case.cancel_after:
                sequence.cancelled = True
                started.cancel()
        return Outcome("OK", answers=answers, cancelled_by_us=sequence.cancelled)
    except grpc.RpcError as e:
        return Outcome(e.code().name, e.details() or "", answers, sequence.cancelled)
    finally:
        sequence.answered.set()


# ---- the stack under test ----------------------------------------------------------------------

def _in_thread(coroutine_fn: Callable, *args):
    """An asyncio call from sync code that may run beside an event loop (pytest-asyncio's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine_fn(*args)).result()


async def _make_turns(redis_url: str, session_id: str, n: int) -> list[str]:
    from services.store.client import connect
    from services.store.turn_log import TurnStore

    redis = connect(redis_url)
    try:
        return [await TurnStore(redis).create(session_id) for _ in range(n)]
    finally:
        await redis.aclose()


class Target:
    """The running services: a channel to each, the real values `hints` gives the fuzzer, the probes."""

    def __init__(self, addresses: dict[str, str], redis_url: str) -> None:
        self.addresses = {k: v for k, v in addresses.items() if k != "redis"}
        self.redis_url = redis_url
        self.channels = {name: grpc.insecure_channel(a, options=CLIENT_OPTIONS) for name, a in self.addresses.items()}
        gw, gw_grpc = protos.load("gateway")
        llm, llm_grpc = protos.load("llm")
        tts, tts_grpc = protos.load("tts")
        gateway = gw_grpc.GatewayStub(self.channels["gateway"])
        self.session_id = gateway.CreateSession(gw.CreateSessionRequest(), timeout=PROBE_TIMEOUT_S).session_id
        caption = gateway.CreateSession(gw.CreateSessionRequest(config=gw.SessionConfig(mode=gw.SessionConfig.CAPTION)),
                                        timeout=PROBE_TIMEOUT_S).session_id
        self.turns = _in_thread(_make_turns, redis_url, self.session_id, 3) + _in_thread(
            _make_turns, redis_url, caption, 2)
        drafters = llm_grpc.LlmStub(self.channels["llm"]).Capabilities(llm.CapabilitiesRequest(), timeout=60)
        voices = tts_grpc.TtsStub(self.channels["tts"]).Capabilities(tts.CapabilitiesRequest(), timeout=60)
        self.hints = hints(session_ids=[self.session_id, caption], turn_ids=self.turns,
                           voices=list(voices.voices), drafters=list(drafters.drafters))

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()

    def call(self, method: Method, case: Case, timeout_s: float = CALL_TIMEOUT_S) -> Outcome:
        return call(self.channels[method.service], method, case, timeout_s)

    def health(self, service: str, name: str = "") -> str:
        """The server's health status by name (SERVING…), or the status of the failed check."""
        stub = health_pb2_grpc.HealthStub(self.channels[service])
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError as e:
            return f"check failed: {e.code().name}: {e.details()}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def probe(self, service: str) -> str | None:
        """A valid request to the service, answered as it should be; None, or what went wrong."""
        try:
            PROBES[service](self)
        except (grpc.RpcError, AssertionError) as e:
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            return f"{service} did not answer a valid request: {detail}"
        return None

    def all_serve(self) -> dict[str, str]:
        """Every service's state: "ok", or what failed (health or its probe)."""
        state = {}
        for service in self.addresses:
            status = self.health(service)
            state[service] = (f"health {status}" if status != "SERVING" else self.probe(service)) or "ok"
        return state


def hints(session_ids: list[str], turn_ids: list[str], voices: list[str], drafters: list[str]) -> dict[str, list]:
    """Real values for the fields the services look up, by field name, drawn beside random ones."""
    return {
        "session_id": session_ids, "turn_id": turn_ids, "voice": voices, "drafter": drafters,
        "language": ["en", "de", "zz", "EN", "en-US"],
        "sample_rate_hz": [16_000, 22_050, 48_000, 8_000, 7_999, 48_001],
        "channels": [1, 2, 3], "sample_width_bytes": [1, 2, 3], "encoding": [1, 2],
        "max_new_tokens": [1, 2, 1_024, 1_025], "max_reply_tokens": [1, 2, 1_024, 1_025],
        "user_text": ["Hi!", "What is the capital of France?"], "text": ["Hello there.", "Hi", "$1,200."],
        "expected_phrases": ["Mm-hmm.", "Yeah"], "backchannels": ["yeah", "mm-hmm"],
    }


def _probe_asr(target: Target) -> None:
    asr, asr_grpc = protos.load("asr")
    common = protos.load_common()
    fmt = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1)
    requests = [asr.TranscribeRequest(config=asr.StreamConfig(session_id=target.session_id, format=fmt)),
                asr.TranscribeRequest(audio=b"\x00" * 16_000)]
    events = list(asr_grpc.AsrStub(target.channels["asr"]).Transcribe(iter(requests), timeout=PROBE_TIMEOUT_S))
    assert events and events[0].kind == asr.TranscriptEvent.READY, events[:1]


def _probe_llm(target: Target) -> None:
    llm, llm_grpc = protos.load("llm")
    score = llm_grpc.LlmStub(target.channels["llm"]).EndOfTurn(
        llm.EndOfTurnRequest(session_id=target.session_id, user_text="What time is it?"), timeout=PROBE_TIMEOUT_S)
    assert 0.0 <= score.probability <= 1.0, score


def _probe_tts(target: Target) -> None:
    tts, tts_grpc = protos.load("tts")
    events = tts_grpc.TtsStub(target.channels["tts"]).Synthesize(tts.SynthesizeRequest(text="Hello there."),
                                                                 timeout=PROBE_TIMEOUT_S)
    assert any(e.WhichOneof("event") == "audio" for e in events), "no audio"


def _probe_gateway(target: Target) -> None:
    gw, gw_grpc = protos.load("gateway")
    common = protos.load_common()
    stub = gw_grpc.GatewayStub(target.channels["gateway"])
    session_id = stub.CreateSession(gw.CreateSessionRequest(), timeout=PROBE_TIMEOUT_S).session_id
    fmt = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1)
    messages = [gw.ClientMessage(start=gw.StreamStart(session_id=session_id, format=fmt)),
                gw.ClientMessage(audio=b"\x00" * 16_000)]
    events = list(stub.Converse(iter(messages), timeout=PROBE_TIMEOUT_S))
    assert [e.WhichOneof("event") for e in events] == ["ready"], events


PROBES: dict[str, Callable[[Target], None]] = {
    "asr": _probe_asr, "llm": _probe_llm, "tts": _probe_tts, "gateway": _probe_gateway}


# ---- a method's run ------------------------------------------------------------------------------

@dataclass
class MethodReport:
    method: str
    cases: int = 0
    kinds: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    problems: list[dict] = field(default_factory=list)
    crashes: int = 0  # cases after which the service did not answer its health check SERVING
    wall_s: float = 0.0

    def add(self, case: Case, outcome: Outcome, health: str) -> str | None:
        self.cases += 1
        self.kinds[case.kind] += 1
        self.statuses[outcome.code] += 1
        wrong = problem(outcome)
        if health != "SERVING":
            self.crashes += 1
            wrong = f"{wrong + '; ' if wrong else ''}service health afterwards: {health}"
        if wrong:
            self.problems.append({"case": case.describe(), "status": outcome.code,
                                  "details": outcome.details[:300], "problem": wrong})
        return wrong

    def as_dict(self) -> dict:
        return {"method": self.method, "cases": self.cases, "kinds": dict(self.kinds),
                "statuses": dict(self.statuses.most_common()), "unclear": len(self.problems) - self.crashes,
                "crashes": self.crashes, "problems": self.problems[:20], "wall_s": round(self.wall_s, 1)}


def fuzz_settings(cases: int, derandomize: bool, shrink: bool) -> settings:
    """hypothesis's settings for one method: `cases` examples, no deadline (a case may take seconds),
    no example database (a run depends on nothing but its seed), every health check off (huge
    strings and slow calls are the point)."""
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    return settings(max_examples=cases, deadline=None, database=None, derandomize=derandomize, phases=phases,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def fuzz_method(target: Target, method: Method, cases: int, *, derandomize: bool = False,
                fail_fast: bool = False, run_seed: int | None = None,
                timeout_s: float = CALL_TIMEOUT_S) -> MethodReport:
    """Up to `cases` hypothesis cases on one method. fail_fast: the first wrong end fails (then shrinks)."""
    report = MethodReport(method.name)

    def check(case: Case) -> None:
        outcome = target.call(method, case, timeout_s)
        health = target.health(method.service, method.service_full_name)
        wrong = report.add(case, outcome, health)
        if fail_fast:
            assert wrong is None, f"{method.name}: {wrong}\n  case: {case.describe(400)}"

    test = fuzz_settings(cases, derandomize, shrink=fail_fast)(given(case_strategy(method, target.hints))(check))
    if run_seed is not None and not derandomize:
        test = seed(run_seed)(test)
    started = time.monotonic()
    try:
        test()
    finally:
        report.wall_s = time.monotonic() - started
    return report


# ---- `specvox bench fuzz` -------------------------------------------------------------------------

def print_table(reports: list[MethodReport], after: dict[str, str]) -> None:
    codes = sorted({c for r in reports for c in r.statuses}, key=lambda c: (c != "OK", c))
    short = {"INVALID_ARGUMENT": "INVALID", "RESOURCE_EXHAUSTED": "RES_EXH", "FAILED_PRECONDITION": "PRECOND",
             "DEADLINE_EXCEEDED": "DEADLINE", "UNAVAILABLE": "UNAVAIL"}
    header = f"{'method':<34} {'cases':>5} {'msg':>4} {'guid':>4} {'bytes':>5} {'seq':>4} " + " ".join(
        f"{short.get(c, c):>9}" for c in codes) + f" {'unclear':>7} {'crashes':>7} {'s':>5}"
    print(header)
    for r in reports:
        print(f"{r.method.removeprefix('specvox.'):<34} {r.cases:>5} {r.kinds['message']:>4} {r.kinds['guided']:>4} "
              f"{r.kinds['bytes']:>5} "
              f"{r.kinds['sequence']:>4} " + " ".join(f"{r.statuses[c]:>9}" for c in codes)
              + f" {len(r.problems) - r.crashes:>7} {r.crashes:>7} {r.wall_s:>5.0f}")
    total = sum(r.cases for r in reports)
    print(f"{'total':<34} {total:>5}")
    for r in reports:
        for p in r.problems[:5]:
            print(f"  {r.method}: {p['problem']}\n    {p['case']}")
    print("after the run: " + ", ".join(f"{k} {v}" for k, v in after.items()))


def run(settings_, cases: int, json_path: str | None, run_seed: int | None = None,
        timeout_s: float = CALL_TIMEOUT_S) -> int:
    import random

    from services.stack import running_stack
    from services.store.embedded import EmbeddedRedis

    run_seed = random.randrange(2**32) if run_seed is None else run_seed
    enumerated = methods()
    print(f"fuzzing {len(enumerated)} methods × {cases} cases (seed {run_seed}) …", flush=True)
    reports: list[MethodReport] = []
    work = Path(tempfile.mkdtemp(prefix="specvox-fuzz-"))
    redis = settings_.redis_url or EmbeddedRedis()  # unless configured, a Valkey whose URL it knows: it reads Redis
    up_data = {"SPECVOX_REDIS__DATA_DIR": str(work / "up")}  # not the user's: its cluster credential, if any
    with running_stack(work, redis=redis, host=settings_.host, env=up_data) as stack:
        listed = check_reflection(stack.addresses, enumerated)
        target = Target(stack.addresses, stack.redis_url)
        pids = {name: p.pid for name, p in stack.processes().items()}
        after_each: dict[str, dict[str, str]] = {}
        try:
            for method in enumerated:
                report = fuzz_method(target, method, cases, run_seed=run_seed, timeout_s=timeout_s)
                after_each[method.name] = target.all_serve()
                reports.append(report)
                bad = {k: v for k, v in after_each[method.name].items() if v != "ok"}
                print(f"  {method.name}: {report.cases} cases, {len(report.problems)} problems, "
                      f"{report.wall_s:.0f} s" + (f"; then {bad}" if bad else ""), flush=True)
            after = target.all_serve()
        finally:
            target.close()
        restarted = sorted(n for n, p in stack.processes().items() if pids.get(n) != p.pid)
    after["restarted processes"] = ", ".join(restarted) or "none"
    print()
    print_table(reports, after)
    results = {
        "cases_per_method": cases, "seed": run_seed, "call_timeout_s": timeout_s, "reflected_services": listed,
        "methods": [r.as_dict() for r in reports],
        "totals": {"methods": len(reports), "cases": sum(r.cases for r in reports),
                   "statuses": dict(sum((r.statuses for r in reports), Counter()).most_common()),
                   "unclear": sum(len(r.problems) - r.crashes for r in reports),
                   "crashes": sum(r.crashes for r in reports)},
        "after_each_method": after_each, "after": after,
    }
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {json_path}")
    clean = not any(r.problems for r in reports) and all(v in ("ok", "none") for v in after.values())
    return 0 if clean else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=int, default=200, help="hypothesis cases per gRPC method")
    parser.add_argument("--seed", type=int, help="hypothesis seed (default: a random one, printed)")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/fuzz.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.cases, args.json_path, args.seed)
