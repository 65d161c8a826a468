"""Logging for the services: plain text, or one JSON object a line (`log_format=json`), each
record carrying the session and turn it was logged for (contextvars, set by `bind`) and, with
OpenTelemetry, the trace and span ids, so a log search and a trace find the same turn.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

try:
    from opentelemetry import trace as otel_trace
except ImportError:  # the otel extra is not installed: no trace ids on records
    otel_trace = None

SESSION_ID: contextvars.ContextVar[str] = contextvars.ContextVar("specvox_session_id", default="")
TURN_ID: contextvars.ContextVar[str] = contextvars.ContextVar("specvox_turn_id", default="")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def bind(session_id: str | None = None, turn_id: str | None = None) -> None:
    """The ids records logged from this context (task) on carry."""
    if session_id is not None:
        SESSION_ID.set(session_id)
    if turn_id is not None:
        TURN_ID.set(turn_id)


class ContextFilter(logging.Filter):
    """Puts the bound ids (and the trace's, with OpenTelemetry) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.session_id = SESSION_ID.get()
        record.turn_id = TURN_ID.get()
        record.trace_id = record.span_id = ""
        if otel_trace is not None:
            context = otel_trace.get_current_span().get_span_context()
            if context.is_valid:
                record.trace_id, record.span_id = f"{context.trace_id:032x}", f"{context.span_id:016x}"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, service, ids, exception."""

    def __init__(self, service: str = "") -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.service:
            out["service"] = self.service
        for key in ("session_id", "turn_id", "trace_id", "span_id"):
            if value := getattr(record, key, ""):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text", service: str = "") -> None:
    """The root logger's handler to stderr, text or JSON (replacing one set here before; handlers
    others added, such as a test runner's, stay)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.set_name("specvox")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "specvox"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
