"""specvox's configuration: defaults, then a TOML file, then SPECVOX_* environment variables.

Stage options are the pipeline's own dataclasses, so a setting has one definition.
Nested values use `__` in the environment: SPECVOX_LLM__MODEL=/models/smol.gguf.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from pipeline.asr import AsrOptions
from pipeline.caption_style import CueStyle
from pipeline.llm.options import LlmOptions
from pipeline.tts.backend import TtsOptions
from pipeline.tts.phrases import PhraseOptions
from pipeline.turn_taking import TurnTakingOptions
from services.server.auth import AuthOptions
from services.server.limits import LimitOptions
from services.server.supervisor import SupervisorOptions
from services.store.client import RedisOptions
from services.store.work_queue import WorkOptions
from services.tls import TlsOptions

CONFIG_ENV = "SPECVOX_CONFIG"
DEFAULT_CONFIG_FILE = "specvox.toml"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECVOX_", env_nested_delimiter="__", extra="forbid")

    redis_url: str | None = None  # None: start an embedded Valkey server
    # Every client's retry deadline, backoff and timeouts; the embedded Valkey's data directory.
    redis: RedisOptions = RedisOptions()
    # How llm and tts workers share turns through Redis consumer groups (services/store/work_queue.py).
    work: WorkOptions = WorkOptions()
    # Turns one worker takes at once: the llm's share each verification pass (0: llm.max_batch_size),
    # the tts's take its model thread in turns, piece by piece.
    llm_concurrency: int = 0
    tts_concurrency: int = 8
    # API keys at the gateway, the service credential inside (services/server/auth.py, docs/security.md).
    auth: AuthOptions = AuthOptions()
    # Certificates: server TLS, mutual TLS, the clients' CA (services/tls.py).
    tls: TlsOptions = TlsOptions()
    # What one API key (tenant) may hold or ask; RESOURCE_EXHAUSTED past each (services/server/limits.py).
    limits: LimitOptions = LimitOptions()
    # Prometheus /metrics of this process on this port (0: none); `specvox up` gives the gateway
    # this port and asr, llm, tts the next three (services/server/metrics.py).
    metrics_port: int = 0
    log_format: str = "text"  # text, or json: one object a line with session_id, turn_id (services/server/logs.py)
    host: str = "127.0.0.1"
    gateway_port: int = 50050
    asr_port: int = 50051
    llm_port: int = 50052
    tts_port: int = 50053
    # The gateway's HTTP and WebSocket surface: the OpenAI HTTP endpoints and the Realtime API, over the same
    # TLS, keys and limits (services/gateway/web.py, docs/protocols.md); 0: off. `specvox up` gives a
    # second gateway worker this port plus supervisor.worker_port_stride.
    http_port: int = 50080
    # The largest request body the HTTP surface reads (413 past it): OpenAI's own limit for an audio upload.
    http_max_body_bytes: int = 25 * 1024 * 1024
    # Where the gateway finds the other services; empty: host:port above.
    asr_address: str = ""
    llm_address: str = ""
    tts_address: str = ""
    # The interpreter `specvox up` runs the tts service with; empty: the one running `up`.
    # The Coqui backend needs its own environment: tts_python = ".venv-coqui/bin/python".
    tts_python: str = ""
    max_message_bytes: int = 4 * 1024 * 1024
    # This process's stable name among a stage's workers (its Redis consumer name, its logs);
    # `specvox up` passes llm-0, llm-1, ...; empty: <service>-<host>-<pid> (worker_name_of).
    worker_name: str = ""
    # On SIGTERM a service takes no new call and gives those in flight, and its workers, this
    # long to finish (services/server/runtime.run_service); `specvox up` SIGKILLs a child past it.
    drain_grace_s: float = 10.0
    # How `specvox up` restarts a crashed child, when it gives up, worker ports (services/server/supervisor.py).
    supervisor: SupervisorOptions = SupervisorOptions()
    # Each service process's CPU priority (its nice value; a service not named keeps 0). The
    # stages that write replies yield the cores to asr and the gateway, whose work is small and
    # on every turn's critical path (the final transcript, the pause): 4 sessions on 2 cores gave
    # asr final p95 453 against 643 ms and pause p95 223 against 266 ms (docs/benchmarks/history.md).
    nice: dict[str, int] = {"llm": 10, "tts": 10}
    # glibc's allocator in each service (services/server/allocator.py): arenas capped (0: glibc's default,
    # 8 per core) and free pages handed back every so many seconds (0: never), so that a
    # long-running process's memory stays flat.
    malloc_arena_max: int = 2
    malloc_trim_interval_s: float = 30.0
    # By service: blocks of this many bytes or more get their own mapping, unmapped when freed (a
    # service not named keeps glibc's threshold, which rises to the largest block freed, up to
    # 32 MiB, so its heap steps up whenever a longer phrase than any before is freed); those
    # mappings in transparent huge pages if `malloc_huge_pages`. The tts starts where glibc's
    # threshold ends (32 MiB: its buffers from the heap from the first phrase, at glibc's speed), so
    # its level is reached in the warm-up, not at a later long phrase; a small threshold ({"tts":
    # 262144}) holds ~70 MB less but synthesizes slower (docs/reliability.md, `bench tts-allocator`).
    malloc_mmap_threshold: dict[str, int] = {"tts": 32 << 20}
    malloc_huge_pages: bool = False
    # By service: "jemalloc" starts it with jemalloc preloaded in place of glibc's malloc (Debian:
    # libjemalloc2; an error where it is missing), freed pages handed back after a second by its
    # background thread; glibc's settings above then do not apply to it. "auto": jemalloc where it
    # is installed, else glibc's with a warning. A service not named keeps glibc's. The tts is on
    # auto: on glibc its heap grew ~25 MB an hour in two-hour soaks, on jemalloc it held its level
    # (docs/reliability.md, "jemalloc for the tts").
    malloc_library: dict[str, str] = {"tts": "auto"}
    turn_budget_ms: int = 800
    token_stream_ttl_s: int = 3600
    # A finished turn's keys (its speech stream's audio, token log, record) are kept this long
    # (services/store/turn_log.finish_turn).
    finished_turn_ttl_s: int = 120
    session_ttl_s: int = 24 * 3600
    token_timeout_s: float = 30.0
    # Start a turn from a stable partial before the final; dropped if the final differs.
    preemptive_generation: bool = True
    # Caption mode: a session's utterances being captioned at once; later ones wait their turn (each holds
    # a Redis connection while it reads its token log, and a file sent unpaced brings hundreds at once).
    caption_turns_per_session: int = 4
    # Caption mode: speech with no pause of asr.end_of_speech_silence_ms is cut (between words) by
    # this long, so a caption arrives within a few seconds of the words however long the speaker goes on
    # (asr.max_utterance_s, 25 s, otherwise). The guides' longest cue is 7 s (captions.max_duration_s).
    caption_max_utterance_s: float = 6.0
    # Caption mode: an utterance begun less than this after the last one's speech ended goes on from the
    # speech before it (the stream's asr.context_pause_ms, which is 0, off, for conversations): a sentence
    # cut at a pause is heard whole, where its caption has time to wait (docs/architecture.md). 0: the asr's.
    # /v1/audio/transcriptions' streams too: a transcript is a record, as a caption is.
    caption_context_pause_ms: int = 2000
    # Caption mode: where the VAD hears speech begin on the stream (asr.vad_threshold, 0.5, otherwise; its
    # silence stays under 0.35, the asr's, or under this where lower). At 0.5 Silero misses quiet speech
    # whole. Going on from the speech before, on `specvox bench asr-finals`' clips, streamed WER as is / 2 dB
    # quieter / mean of 4 versions: 0.169 / 0.211 / 0.178 at 0.5, 0.155 / 0.174 / 0.158 at 0.3. Silence
    # under 0.2 too (Silero's hysteresis at 0.35) did alike (mean 0.155) but joined utterances live across
    # short pauses ("in 2019." + "Uh, for work." as "in 2019, forward."), later and garbled. A
    # conversation keeps 0.5, as its avatar pauses on the voice the VAD hears. 0: the asr's. Also
    # /v1/audio/transcriptions' streams and `specvox captions` (files).
    caption_vad_threshold: float = 0.3
    # Caption mode: how much louder Silero hears the stream than it is (asr.vad_gain_db; whisper hears it as
    # it is). On some voices Silero's probability falls steeply with the level: on a speaker with a cold, 0.5
    # as recorded, 0.2 at 2 dB quieter, and at 0.3 a whole sentence went unheard. `specvox bench asr-finals`'
    # human recordings, four versions each, streamed with caption options (offline: 327 errors in 2336 words):
    # 380 errors at 0 dB, 368 at 4, 349 at 6, 348 at 8, 367 at 10, 362 normalised to a 0.9 running peak; the
    # bundled voices' 126 at 0 and 6 (noise, music, clicks: no final at either; hums an empty one at 6). Also
    # /v1/audio/transcriptions' streams and `specvox captions` (files). 0: the asr's (0 dB).
    caption_vad_gain_db: float = 6.0

    asr: AsrOptions = AsrOptions()
    llm: LlmOptions = LlmOptions()
    tts: TtsOptions = TtsOptions()
    phrases: PhraseOptions = PhraseOptions()
    turn_taking: TurnTakingOptions = TurnTakingOptions()
    # Broadcast-style caption cues: lines, reading speed, durations, the gap (pipeline/caption_style.py).
    captions: CueStyle = CueStyle()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = Path(os.environ.get(CONFIG_ENV, DEFAULT_CONFIG_FILE))
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if path.is_file():
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=path),)
        elif CONFIG_ENV in os.environ:
            raise FileNotFoundError(f"{CONFIG_ENV} names {path}, which does not exist")
        return sources

    def worker_name_of(self, service: str) -> str:
        """`worker_name`, or one unique to this process: a restarted worker named by `specvox up`
        keeps its name (and takes its own pending work back); an unnamed one never collides."""
        return self.worker_name or f"{service}-{socket.gethostname()}-{os.getpid()}"

    def address(self, service: str) -> str:
        explicit = getattr(self, f"{service}_address", "")
        return explicit or f"{self.host}:{getattr(self, f'{service}_port')}"
