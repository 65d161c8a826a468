"""Prometheus metrics of every service (prometheus_client, the project's default registry).

Names follow Prometheus conventions: a `specvox_` prefix, the unit in the name (`_seconds`,
`_tokens`, `_entries`), `_total` on counters. Latencies of a turn are observed once, from the
gateway's turn report (`observe_turn`), measured from the end of the user's speech as the
gateway received it; the decoding counters come from the llm's statistics of each reply.
Each process serves its own on `metrics_port` (0: none).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from services.server.interceptors import wrap_handler

log = logging.getLogger(__name__)

# Latencies from the end of speech: 5 ms to 10 s, finer where the budget (800 ms) lies.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8,
                     0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)

REQUESTS = Counter("specvox_requests_total", "gRPC calls finished, by service, method and status code",
                   ["service", "method", "code"])
ACTIVE_REQUESTS = Gauge("specvox_active_requests", "gRPC calls in progress (Converse: live sessions)",
                        ["service", "method"])
REQUEST_DURATION = Histogram("specvox_request_duration_seconds", "gRPC call duration, streams included",
                             ["service", "method"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                                             10, 30, 60, 300))

ASR_FINAL = Histogram("specvox_asr_final_after_speech_end_seconds",
                      "asr's final transcript after the end of the user's speech", buckets=LATENCY_BUCKETS_S)
LLM_FIRST_TOKEN = Histogram("specvox_llm_first_token_seconds",
                            "the llm's first verified token after the end of speech", buckets=LATENCY_BUCKETS_S)
FIRST_PHRASE = Histogram("specvox_first_phrase_seconds",
                         "the reply's first phrase complete (as tts cuts it) after the end of speech",
                         buckets=LATENCY_BUCKETS_S)
TTS_FIRST_AUDIO = Histogram("specvox_tts_first_audio_seconds",
                            "tts's first reply audio after the end of speech", buckets=LATENCY_BUCKETS_S)
VOICE_TO_VOICE = Histogram("specvox_voice_to_voice_seconds",
                           "end of the user's speech to the first reply audio sent to the client",
                           buckets=LATENCY_BUCKETS_S)
TURNS = Counter("specvox_turns_total", "turns over, by mode and finish reason", ["mode", "finish_reason"])
BUDGET_MISSES = Counter("specvox_budget_misses_total", "turns whose first audio came after their budget")
DEGRADATIONS = Counter("specvox_degradations_total", "budget degradations taken, by stage and name",
                       ["stage", "name"])
ACTIVE_TURNS = Gauge("specvox_active_turns", "turns under way at the gateway")
ACTIVE_SESSIONS = Gauge("specvox_active_sessions", "Converse streams open at the gateway")

DRAFTED = Counter("specvox_llm_drafted_tokens_total", "draft tokens proposed, by drafter and draft position",
                  ["drafter", "position"])
ACCEPTED = Counter("specvox_llm_accepted_tokens_total", "draft tokens accepted, by drafter and draft position",
                   ["drafter", "position"])
DECODE_STEPS = Counter("specvox_llm_decode_steps_total", "verify steps (target passes) of replies, by drafter",
                       ["drafter"])
GENERATED = Counter("specvox_llm_generated_tokens_total", "tokens committed by replies, by drafter", ["drafter"])
MEAN_ACCEPTED = Gauge("specvox_llm_mean_accepted_length_tokens",
                      "tokens per verify step of the last reply, by drafter (rate of generated/steps over time)",
                      ["drafter"])

STREAM_LAG = Gauge("specvox_redis_stream_lag_entries", "work entries not yet delivered to the stage's group",
                   ["stream", "group"])
STREAM_PENDING = Gauge("specvox_redis_stream_pending_entries", "work entries delivered and not yet acked",
                       ["stream", "group"])
DEAD_LETTERS = Gauge("specvox_redis_dead_letter_entries", "work entries dead-lettered", ["stream"])
LIMITED = Counter("specvox_limited_total", "calls refused by a limit (RESOURCE_EXHAUSTED), by limit", ["limit"])


def _method(full: str) -> str:
    """'/specvox.llm.v1.Llm/Reply' → 'Llm/Reply'."""
    service, _, method = full.rpartition("/")
    return f"{service.rpartition('.')[2]}/{method}"


def _code_name(context) -> str:
    code = context.code()
    if code is None:
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


class RequestMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts each call by its final status, and the calls in progress."""

    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return wrap_handler(handler, functools.partial(self._counted, _method(handler_call_details.method)))

    @contextlib.asynccontextmanager
    async def _counted(self, method: str, request, context) -> AsyncIterator[Any]:
        service = self.service
        gateway_converse = service == "gateway" and method.endswith("/Converse")
        ACTIVE_REQUESTS.labels(service, method).inc()
        if gateway_converse:
            ACTIVE_SESSIONS.inc()
        started, code = time.perf_counter(), "UNKNOWN"
        try:
            yield request
            code = _code_name(context)
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit) as e:
            code = _code_name(context) if isinstance(e, grpc.aio.AbortError) else "CANCELLED"
            raise
        finally:
            ACTIVE_REQUESTS.labels(service, method).dec()
            if gateway_converse:
                ACTIVE_SESSIONS.dec()
            REQUESTS.labels(service, method, code).inc()
            REQUEST_DURATION.labels(service, method).observe(time.perf_counter() - started)


def _after_s(unix_ms: int, speech_end_unix_ms: int) -> float | None:
    """Seconds after the end of speech; None when the event did not happen. Work started early
    (from a stable partial) can come before the end: counted as 0."""
    if not unix_ms or not speech_end_unix_ms:
        return None
    return max(0.0, (unix_ms - speech_end_unix_ms) / 1000)


def observe_turn(report: Any, first_phrase_unix_ms: int = 0) -> None:
    """A gateway TurnReport (gateway.v1) into the turn histograms and counters."""
    TURNS.labels(report.mode or "dialogue", report.finish_reason or "unknown").inc()
    if report.budget_missed:
        BUDGET_MISSES.inc()
    for d in report.degradations:
        DEGRADATIONS.labels(d.stage, d.name).inc()
    end = report.speech_end_unix_ms
    stages = {s.stage: s for s in report.stages}
    observed = [
        (ASR_FINAL, stages["asr"].last_out_unix_ms if "asr" in stages else 0),
        (LLM_FIRST_TOKEN, stages["llm"].first_out_unix_ms if "llm" in stages else 0),
        (FIRST_PHRASE, first_phrase_unix_ms),
        (TTS_FIRST_AUDIO, stages["tts"].first_out_unix_ms if "tts" in stages else 0),
        (VOICE_TO_VOICE, report.first_audio_sent_unix_ms),
    ]
    for histogram, at_ms in observed:
        if (seconds := _after_s(at_ms, end)) is not None:
            histogram.observe(seconds)


def observe_decoding(drafter: str, stats: Any) -> None:
    """A reply's GenerationStats (pipeline/llm/engine.py) into the speculative-decoding counters."""
    if stats is None or not stats.steps:
        return
    for position, (drafted, accepted) in enumerate(zip(stats.drafted_at, stats.accepted_at, strict=False)):
        if drafted:
            DRAFTED.labels(drafter, str(position)).inc(drafted)
            ACCEPTED.labels(drafter, str(position)).inc(accepted)
    DECODE_STEPS.labels(drafter).inc(stats.steps)
    GENERATED.labels(drafter).inc(stats.new_tokens)
    MEAN_ACCEPTED.labels(drafter).set(stats.mean_accepted_len)


_conversations: weakref.WeakSet = weakref.WeakSet()
ACTIVE_TURNS.set_function(lambda: sum(len(getattr(c, "work", ())) for c in list(_conversations)))


def track_conversation(conversation: Any) -> None:
    """The gateway's live conversations: their turns under way are `specvox_active_turns`."""
    _conversations.add(conversation)


def limited(limit: str) -> None:
    LIMITED.labels(limit).inc()


async def watch_streams(redis: Any, stages: Iterable[str] = ("llm", "tts"), every_s: float = 5.0) -> None:
    """The work streams' consumer-group lag and pending counts (XINFO GROUPS), every `every_s`."""
    from services.store.keys import dead_key, work_key

    while True:
        for stage in stages:
            with contextlib.suppress(Exception):  # no stream yet, or Redis away: the last value stays
                for group in await redis.xinfo_groups(work_key(stage)):
                    name = str(group.get("name"))
                    STREAM_PENDING.labels(work_key(stage), name).set(int(group.get("pending") or 0))
                    if group.get("lag") is not None:
                        STREAM_LAG.labels(work_key(stage), name).set(int(group["lag"]))
                DEAD_LETTERS.labels(work_key(stage)).set(int(await redis.xlen(dead_key(stage))))
        await asyncio.sleep(every_s)


def start_endpoint(settings: Any, service: str) -> int:
    """Serve /metrics over HTTP on `settings.metrics_port` (HTTPS with the service's certificate
    when TLS is on, and only to scrapers with a certificate of `tls.client_ca_file` under mutual
    TLS, as the gRPC ports); 0: off. Returns the port."""
    port = int(getattr(settings, "metrics_port", 0) or 0)
    if not port:
        return 0
    tls = settings.tls
    mutual = bool(tls.cert_file and tls.client_ca_file)
    start_http_server(port, addr=settings.host, certfile=tls.cert_file or None, keyfile=tls.key_file or None,
                      client_cafile=tls.client_ca_file if mutual else None, client_auth_required=mutual)
    log.info("%s: metrics on http%s://%s:%d/metrics%s", service, "s" if tls.cert_file else "", settings.host, port,
             " (client certificates required)" if mutual else "")
    return port
