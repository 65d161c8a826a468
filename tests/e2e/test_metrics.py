"""Metrics and traces after a real spoken turn through the four services (in this process, so
one registry and OpenTelemetry's in-memory exporter see them all), scraped from the real
/metrics endpoint and parsed with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.audio import PcmFormat, float_to_pcm16
from services.client import ClientOptions, Say, converse_script
from services.server.metrics import start_endpoint
from services.settings import Settings
from services.stack import free_port
from tests.grpc_status import expect_status
from tests.inprocess import four_services

QUESTION = "What is the capital of France?"
TURN_HISTOGRAMS = ("specvox_asr_final_after_speech_end_seconds", "specvox_llm_first_token_seconds",
                   "specvox_first_phrase_seconds", "specvox_tts_first_audio_seconds", "specvox_voice_to_voice_seconds")

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def spans():
    """OpenTelemetry's in-memory exporter behind this process's tracer provider (the otel extra)."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError:
        import os

        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("the otel extra is not installed; CI installs it with the test extra")
        return None
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # set once a process: an earlier test may have set it
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
async def turn(redis_url, speech, spans):
    """One spoken turn; yields (the client's turns, the scraped metric families by name)."""
    settings = Settings(redis_url=redis_url, metrics_port=free_port())
    start_endpoint(settings, "test")
    before = _scrape(settings.metrics_port)  # the process's registry holds what earlier tests counted too
    async with four_services(settings) as addresses:
        samples = speech(QUESTION, 16_000)
        turns = await converse_script(addresses["gateway"], [Say(float_to_pcm16(samples))], PcmFormat(16_000, 1, 2),
                                      ClientOptions(chunk_ms=100, realtime=True))
    after = _scrape(settings.metrics_port)
    yield turns, {name: _added(family, before.get(name)) for name, family in after.items()}


def _scrape(port: int) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(body)}


def _added(family, before):
    """A counter's or histogram's samples less their values before the turn (gauges as they are)."""
    if before is None or family.type not in ("counter", "histogram"):
        return family
    earlier = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in before.samples}
    family.samples = [s._replace(value=s.value - earlier.get((s.name, tuple(sorted(s.labels.items()))), 0.0))
                      for s in family.samples]
    return family


def _value(family, sample_name: str, **labels) -> float:
    return sum(s.value for s in family.samples if s.name == sample_name
               and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_turn_latencies_in_the_histograms(turn):
    turns, families = turn
    report = next(t.report for t in turns if t.report)
    assert report["reply_text"].strip()
    for name in TURN_HISTOGRAMS:
        family = families[name.removesuffix("_seconds") + "_seconds"]
        assert family.type == "histogram"
        assert _value(family, name + "_count") == 1, name
    v2v = families["specvox_voice_to_voice_seconds"]
    observed = _value(v2v, "specvox_voice_to_voice_seconds_sum")
    # the gateway's figure is the client's (speech end to first audio), up to the loopback hop
    assert abs(observed - report["voice_to_voice_ms"] / 1000) < 0.5, (observed, report["voice_to_voice_ms"])
    for sample in v2v.samples:  # the one turn lies in every bucket at or above it, in none below
        if sample.name.endswith("_bucket"):
            assert sample.value == (1 if float(sample.labels["le"]) >= observed else 0), sample
    assert _value(families["specvox_turns"], "specvox_turns_total", mode="dialogue") == 1


async def test_requests_counted_by_service_method_and_code(turn):
    _, families = turn
    requests = families["specvox_requests"]
    assert _value(requests, "specvox_requests_total", service="gateway", method="Gateway/CreateSession",
                  code="OK") == 1
    assert _value(requests, "specvox_requests_total", service="gateway", method="Gateway/Converse", code="OK") == 1
    # A turn's reply and speech go through the work queues (no call); the score and the capabilities are calls.
    assert _value(requests, "specvox_requests_total", service="llm", method="Llm/EndOfTurn", code="OK") >= 1
    assert _value(requests, "specvox_requests_total", service="tts", method="Tts/Capabilities", code="OK") >= 1
    assert _value(requests, "specvox_requests_total", service="asr", method="Asr/Transcribe", code="OK") == 1
    assert _value(families["specvox_active_sessions"], "specvox_active_sessions") == 0


async def test_budget_and_call_figures_match_the_turn(turn):
    """The budget's counters say what the turn's report says; the gateway's stream was timed once,
    and no turn is left under way."""
    turns, families = turn
    report = next(t.report for t in turns if t.report)
    missed = _value(families["specvox_budget_misses"], "specvox_budget_misses_total")
    assert missed == (1 if report["budget_missed"] else 0)
    taken = report["degradations"]  # "stage:name"
    assert _value(families["specvox_degradations"], "specvox_degradations_total") == len(taken)
    for degradation in taken:
        stage, name = degradation.split(":")
        assert _value(families["specvox_degradations"], "specvox_degradations_total", stage=stage, name=name) >= 1
    duration = families["specvox_request_duration_seconds"]
    assert _value(duration, "specvox_request_duration_seconds_count", service="gateway",
                  method="Gateway/Converse") == 1
    assert _value(duration, "specvox_request_duration_seconds_sum", service="gateway",
                  method="Gateway/Converse") > report["voice_to_voice_ms"] / 1000  # the stream outlasts the turn
    assert _value(families["specvox_active_turns"], "specvox_active_turns") == 0


async def test_decoding_counters(turn):
    _, families = turn
    steps = _value(families["specvox_llm_decode_steps"], "specvox_llm_decode_steps_total")
    generated = _value(families["specvox_llm_generated_tokens"], "specvox_llm_generated_tokens_total")
    assert steps >= 1 and generated >= 1  # the step that ends a reply may commit no token
    drafted = families["specvox_llm_drafted_tokens"]
    accepted = families["specvox_llm_accepted_tokens"]
    for sample in drafted.samples:
        if sample.name.endswith("_total"):
            assert _value(accepted, "specvox_llm_accepted_tokens_total", **sample.labels) <= sample.value
    # The gauge is the last reply's, by drafter; the registry is the process's, so it also holds the
    # labels of replies that earlier tests' in-process llm services decoded. This turn's one reply
    # is the last of its drafter: tokens over steps of what this turn added under that label.
    used = {s.labels["drafter"] for s in families["specvox_llm_decode_steps"].samples
            if s.name == "specvox_llm_decode_steps_total" and s.value > 0}
    assert used
    for drafter in used:
        mean = _value(families["specvox_llm_mean_accepted_length_tokens"], "specvox_llm_mean_accepted_length_tokens",
                      drafter=drafter)
        assert mean == pytest.approx(
            _value(families["specvox_llm_generated_tokens"], "specvox_llm_generated_tokens_total", drafter=drafter)
            / _value(families["specvox_llm_decode_steps"], "specvox_llm_decode_steps_total", drafter=drafter)), drafter


def test_nothing_breaks_without_the_otel_packages():
    """The real turn above and its metrics, in a process where OpenTelemetry cannot be imported."""
    import os
    import subprocess
    import sys

    tests = "latencies or budget_and_call or requests_counted"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.without_otel", "-p", "no:cacheprovider",
         __file__, "-k", tests], env={**os.environ, "CI": ""}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout, result.stdout[-2000:]


async def test_a_turn_is_one_trace_across_the_four_services(turn, spans):
    if spans is None:
        pytest.skip("the otel extra is not installed (pip install -e '.[otel]')")
    import asyncio

    turns, _ = turn
    turn_id = next(t.turn_id for t in turns if t.report)
    for _ in range(100):  # a worker's span ends when its work entry does, which may be after the client's turn
        finished = spans.get_finished_spans()
        turn_span = next(s for s in finished if s.name == "turn" and s.attributes["specvox.turn_id"] == turn_id)
        trace_id = turn_span.context.trace_id
        in_trace = [s for s in finished if s.context.trace_id == trace_id]
        services = {s.attributes.get("specvox.service") for s in in_trace} - {None}
        if services == {"gateway", "asr", "llm", "tts"}:
            break
        await asyncio.sleep(0.1)
    assert services == {"gateway", "asr", "llm", "tts"}, [s.name for s in in_trace]
    by_id = {s.context.span_id: s for s in in_trace}
    reply = next(s for s in in_trace if s.name.endswith("Llm/Reply"))
    speak = next(s for s in in_trace if s.name.endswith("Tts/SpeakTurn"))
    for span in (reply, speak):  # the turn's work, taken from the queues, hangs under the turn's span
        assert span.parent is not None and by_id[span.parent.span_id] is turn_span


async def test_json_logs_carry_the_session_and_turn_ids(capfd):
    """log_format=json: one object a line; a record logged inside a turn's context has its ids."""
    import asyncio
    import json
    import logging

    from services.server import logs, tracing

    level = logging.getLogger().level
    logs.configure_logging("INFO", "json", "gateway")
    try:
        turn = tracing.TurnSpan("session-1", "turn-1", "dialogue")

        async def in_turn():
            logging.getLogger("specvox.test").info("replying")

        await asyncio.get_running_loop().create_task(in_turn(), context=turn.context())
        logging.getLogger("specvox.test").warning("outside")
        traced = turn.span is not None and turn.span.get_span_context().is_valid  # a tracer provider is set
        turn.end()
    finally:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if h.get_name() == "specvox"]:
            root.removeHandler(handler)  # leave the test runner's logging as it was
        root.setLevel(level)
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    inside = next(r for r in lines if r["message"] == "replying")
    assert (inside["session_id"], inside["turn_id"], inside["service"], inside["level"]) == \
        ("session-1", "turn-1", "gateway", "INFO")
    outside = next(r for r in lines if r["message"] == "outside")
    assert "turn_id" not in outside
    if traced:
        assert len(inside["trace_id"]) == 32
    with pytest.raises(ValueError, match="log_format"):
        logs.configure_logging("INFO", "yaml")


async def test_work_stream_lag_and_pending():
    """The gateway's watcher reads the work streams' consumer-group lag and pending entries
    (XINFO GROUPS) from a real Valkey of its own into the gauges."""
    import asyncio

    from prometheus_client import REGISTRY

    from services.server.metrics import watch_streams
    from services.store.client import connect
    from services.store.embedded import EmbeddedRedis
    from services.store.keys import work_key
    from services.store.work_queue import WorkQueue

    def gauge(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"stream": work_key("llm"), "group": "llm"})

    async def watched(lag: float, pending: float) -> None:
        watcher = asyncio.create_task(watch_streams(redis, ("llm",), every_s=0.05))
        try:
            for _ in range(200):  # until the watcher has been round once with these values
                if (gauge("specvox_redis_stream_lag_entries"), gauge("specvox_redis_stream_pending_entries")) == \
                        (lag, pending):
                    return
                await asyncio.sleep(0.05)
            pytest.fail(f"lag/pending never read as {lag}/{pending}")
        finally:
            watcher.cancel()

    with EmbeddedRedis() as valkey:
        redis = connect(valkey.url)
        queue = WorkQueue(redis, "llm", "llm-test")
        for i in range(3):
            await queue.add({"turn": str(i)})
        await watched(lag=3, pending=0)
        await queue.claim(2, block_ms=100)
        await watched(lag=1, pending=2)
        await redis.aclose()


async def test_spans_are_exported_over_otlp_to_a_collector(redis_url, tmp_path):
    """`specvox serve gateway` with OTEL_EXPORTER_OTLP_ENDPOINT set sends its spans over OTLP/gRPC
    to a real receiver (opentelemetry-proto's TraceService on loopback): a CreateSession made
    inside a trace arrives as the gateway's SERVER span, in that trace, under its service name,
    marked failed (the gateway runs alone, so the call ends UNAVAILABLE).
    A process of its own: the exporter is set up once a process, from the environment."""
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    import grpc
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc", reason="the otel extra brings the OTLP exporter")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    from services.protos import load
    from tests.e2e.test_supervisor import wait_for

    received: asyncio.Queue = asyncio.Queue()

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        async def Export(self, request, context):  # noqa: N802 - the proto's name
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        received.put_nowait((attributes.get("service.name"), span))
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    collector_port = collector.add_insecure_port("127.0.0.1:0")
    await collector.start()
    gateway_port, log = free_port(), tmp_path / "gateway.log"
    env = dict(os.environ, SPECVOX_REDIS_URL=redis_url, SPECVOX_GATEWAY_PORT=str(gateway_port),
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector_port}", OTEL_EXPORTER_OTLP_INSECURE="true",
               OTEL_BSP_SCHEDULE_DELAY="100")
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "gateway"], env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        wait_for(log, r"specvox gateway .* listening", process)
        gw, gw_grpc = load("gateway")
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
            # no llm runs: the session's config cannot be checked
            await expect_status(grpc.StatusCode.UNAVAILABLE, "", gw_grpc.GatewayStub(channel).CreateSession(
                gw.CreateSessionRequest(), timeout=30,
                metadata=(("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),)))
        while True:
            service, span = await asyncio.wait_for(received.get(), 30)
            if span.name.endswith("CreateSession"):
                break
        assert service == "specvox-gateway"
        assert span.trace_id.hex() == trace_id and span.parent_span_id.hex() == "00f067aa0ba902b7"
        assert span.kind == span.SPAN_KIND_SERVER
        assert span.status.code == span.status.STATUS_CODE_ERROR  # the failed call is marked so
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        await collector.stop(None)
