"""Every Redis key specvox uses, built here and nowhere else (all prefixed `sv:`).

Sessions (services/store/sessions.py, services/server/limits.py):
- `sv:session:{session_id}`            hash: system_prompt, config (SessionConfig as JSON), owner (the
                                       tenant), created_unix_ms
- `sv:session:{session_id}:history`    list of JSON {"user", "assistant", "cut_off"}, oldest first:
                                       what the user heard of each reply
- `sv:session:{session_id}:turns`      integer: the session's turns so far (limits.max_turns_per_session)

Turns (services/store/turn_log.py):
- `sv:turn:{turn_id}`                  hash: session_id, created_unix_ms; per stage (llm, tts) the
                                       writer's epoch and last entry number (`llm_epoch`, `llm_seq`, …,
                                       see TurnLogWriter) and its plan (`llm_plan`, `tts_plan`); the
                                       effects done once (`done_history`), `done_unix_ms` once it ended
- `sv:turn:{turn_id}:tokens`           stream, one entry per verify step (see TokenEntry): the token log
- `sv:turn:{turn_id}:speech`           stream, the tts output: phrases, words, audio chunks, cues (SpeechEntry)
- `sv:turn:{turn_id}:cancel`           string: set when the turn is cancelled (barge-in, client gone)

Work queues, one per stage (services/store/work_queue.py):
- `sv:work:{stage}`                    stream + consumer group `{stage}`: one entry per turn to do
- `sv:work:{stage}:dead`               stream: dead letters (the entry, its last error, its attempts)
- `sv:work:{stage}:attempts`           hash: per pending entry, its deliveries' consumers and errors
- `sv:work:{stage}:alive:{consumer}`   string: a worker's heartbeat (turns held, pid)

Per-tenant limits (services/server/limits.py; the tenant "" is written `_`):
- `sv:tenant:{tenant}:rate`            string: the GCRA theoretical arrival time of the next call
- `sv:tenant:{tenant}:streams`         sorted set: open stream leases scored by their end
- `sv:tenant:{tenant}:sessions`        sorted set: held sessions scored by their expiry
"""

from __future__ import annotations


def session_key(session_id: str) -> str:
    return f"sv:session:{session_id}"


def history_key(session_id: str) -> str:
    return f"sv:session:{session_id}:history"


def session_turns_key(session_id: str) -> str:
    return f"sv:session:{session_id}:turns"


def turn_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}"


def token_stream_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}:tokens"


def speech_stream_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}:speech"


def cancel_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}:cancel"


def work_key(stage: str) -> str:
    return f"sv:work:{stage}"


def dead_key(stage: str) -> str:
    return f"sv:work:{stage}:dead"


def attempts_key(stage: str) -> str:
    return f"sv:work:{stage}:attempts"


def heartbeat_key(stage: str, consumer: str) -> str:
    return f"sv:work:{stage}:alive:{consumer}"


def tenant_rate_key(tenant: str) -> str:
    return f"sv:tenant:{tenant or '_'}:rate"


def tenant_streams_key(tenant: str) -> str:
    return f"sv:tenant:{tenant or '_'}:streams"


def tenant_sessions_key(tenant: str) -> str:
    return f"sv:tenant:{tenant or '_'}:sessions"
