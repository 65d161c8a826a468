"""The OpenAI Realtime API's session, as specvox runs it: `session.update` checked and mapped onto the
gateway's `SessionConfig` and turn-taking options, and the effective session written back in either
dialect (GA, or beta for clients that send `OpenAI-Beta: realtime=v1`).

Pure: dicts in, dataclasses and dicts out, a `RealtimeError` (an OpenAI-shaped `error` event's
contents) for anything refused; services/gateway/realtime_events.py converts the conversation's events
and services/gateway/realtime.py carries the WebSocket. docs/protocols.md, "OpenAI Realtime API",
tables what maps where.

Turn detection: specvox's own end of turn (a final after the VAD's silence, confirmed by the llm's
end-of-turn score, or by more silence when the score says the user is mid-sentence) is a semantic
detector, so the default session says `semantic_vad`; its `eagerness` scales the wait after a low score.
`server_vad` is silence alone: the turn is taken after `silence_duration_ms` of silence (never less than
the asr's own end-of-speech silence), with no score. `null` turns it off: the client commits the audio
and asks for each response.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.turn_taking import TurnTakingOptions
from services import session_config
from services.gateway.convert import Config, common

Dialect = Literal["ga", "beta"]
PCM, PCMU, PCMA = "audio/pcm", "audio/pcmu", "audio/pcma"
FORMAT_RATE_HZ = {PCM: 24_000, PCMU: 8_000, PCMA: 8_000}  # what each format carries (pcm: 24 kHz, the API's)
BETA_FORMATS = {"pcm16": PCM, "g711_ulaw": PCMU, "g711_alaw": PCMA}
BETA_NAME = {v: k for k, v in BETA_FORMATS.items()}
EAGERNESS_WAIT = {"low": 2.0, "medium": 1.0, "auto": 1.0, "high": 0.5}  # × turn_taking.incomplete_wait_s
NEVER_BY_SCORE = 1.01  # an end-of-turn threshold no score reaches: silence alone confirms a turn
MODEL = "specvox"
TRANSCRIPTION_MODEL = "whisper-1"  # the name the asr's whisper answers to in the session
# Accepted and not applied (they change nothing a voice reply of specvox's depends on) / echoed as given.
IGNORED_GA = {"type", "object", "id", "expires_at", "include", "tracing", "truncation", "model", "tool_choice",
              "parallel_tool_calls", "reasoning", "client_secret"}
IGNORED_BETA = {"object", "id", "expires_at", "tracing", "model", "tool_choice", "client_secret", "include"}


class RealtimeError(ValueError):
    """A client event refused: the contents of the OpenAI-shaped `error` event (the connection stays)."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class TurnDetection:
    type: Literal["server_vad", "semantic_vad"] = "semantic_vad"
    eagerness: str = "auto"  # semantic_vad
    silence_duration_ms: int = 500  # server_vad
    threshold: float = 0.5  # the asr's VAD threshold (its own setting: echoed, not set per session)
    prefix_padding_ms: int = 300  # the asr's (likewise)
    create_response: bool = True  # false: an utterance is committed, the client asks for the reply
    interrupt_response: bool = True  # false: speech over a reply neither pauses nor cancels it


@dataclass(frozen=True)
class RealtimeSession:
    """The effective session: what `session.updated` echoes, whole."""

    session_id: str
    model: str = MODEL  # the name the client connected with (its `model` query parameter), echoed
    instructions: str = ""
    voice: str = ""
    input_format: str = PCM
    output_format: str = PCM
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    transcription_language: str = ""
    transcribe: bool = True  # the asr transcribes every utterance; the session only says whether it is shown
    max_output_tokens: int = 0  # 0: "inf" (the llm's own cap)
    temperature: float = 0.0  # 0: greedy (specvox's default); the beta dialect may set it
    extension_events: bool = False  # `specvox.*` events (word cues, visemes, turn reports, pauses)
    drafter: str = ""  # specvox's own settings, under `session.specvox`: the llm's drafter ("": the session's)
    budget_ms: int = 0  # the turn's latency budget (0: the session's)
    mode: str = "dialogue"  # the session's mode, fixed for a connection (a caption session: name it)

    def session_config(self, base: Any) -> Any:
        """The gateway SessionConfig this session asks for, over the stored `base`."""
        out = Config()
        out.CopyFrom(base)
        out.system_prompt = self.instructions
        out.voice = self.voice
        out.reply_sample_rate_hz = FORMAT_RATE_HZ[self.output_format]
        out.max_reply_tokens = self.max_output_tokens
        out.drafter = self.drafter or out.drafter
        out.budget_ms = self.budget_ms or out.budget_ms
        if self.transcription_language:
            out.language = self.transcription_language
        if self.temperature:
            out.sampling.CopyFrom(common.Sampling(temperature=self.temperature))
        return out

    def turn_taking(self, base: TurnTakingOptions, asr_silence_ms: int) -> TurnTakingOptions:
        """The turn-taking options of this session's turn detection (None: the base; turns are not taken then)."""
        td = self.turn_detection
        if td is None:
            return base
        flagged = dataclasses.replace(base, start_turns=td.create_response, interruptions=td.interrupt_response)
        if td.type == "semantic_vad":
            return dataclasses.replace(flagged, incomplete_wait_s=base.incomplete_wait_s * EAGERNESS_WAIT[td.eagerness])
        extra_s = max(0, td.silence_duration_ms - asr_silence_ms) / 1000
        return dataclasses.replace(flagged, end_of_turn_threshold=NEVER_BY_SCORE if extra_s else 0.0,
                                   incomplete_wait_s=extra_s)


def initial(session_id: str, config: Any, asr: Any, model: str = "") -> RealtimeSession:
    """The session as a connection starts: the specvox session's config, specvox's turn-taking."""
    return RealtimeSession(session_id, model=model or MODEL, instructions=config.system_prompt, voice=config.voice,
                           drafter=config.drafter, budget_ms=config.budget_ms,
                           mode="caption" if config.mode == Config.CAPTION else "dialogue",
                           transcription_language=config.language, max_output_tokens=config.max_reply_tokens,
                           turn_detection=TurnDetection(threshold=asr.vad_threshold,
                                                        prefix_padding_ms=asr.transcribe_pad_ms,
                                                        silence_duration_ms=asr.end_of_speech_silence_ms))


def updated(session: RealtimeSession, asked: Any, dialect: Dialect, voices: tuple[str, ...],
            asr: Any) -> RealtimeSession:
    """`session` with a `session.update`'s `session` object applied; RealtimeError names what is refused
    (nothing of the update is applied then)."""
    if not isinstance(asked, dict):
        raise RealtimeError("session must be an object", "invalid_type", "session")
    changes = _changes_beta(asked) if dialect == "beta" else _changes_ga(asked)
    out = dataclasses.replace(session, **{k: v for k, v in changes.items() if k != "turn_detection_raw"})
    if "turn_detection_raw" in changes:
        out = dataclasses.replace(out, turn_detection=_turn_detection(changes["turn_detection_raw"], session, asr))
    if out.mode != session.mode:
        raise RealtimeError(f"this connection's session is in {session.mode} mode, for good: to caption, create a "
                            "session with mode CAPTION and name it (?session_id=)", "unsupported_value",
                            "session.specvox.mode")
    if out.voice not in voices:
        raise RealtimeError(f"unknown voice {out.voice!r}; choose one of {', '.join(voices)}", "invalid_value",
                            "session.audio.output.voice" if dialect == "ga" else "session.voice")
    return out


def instructions_of(value: Any, param: str) -> str:
    """`instructions` (the session's, or one response's) checked: a string no longer than a system prompt may be."""
    if not isinstance(value, str):
        raise RealtimeError("instructions must be a string", "invalid_type", param)
    if len(value) > session_config.MAX_SYSTEM_PROMPT_CHARS:
        raise RealtimeError(f"instructions: {len(value)} characters; at most {session_config.MAX_SYSTEM_PROMPT_CHARS}",
                            "string_above_max_length", param)
    return value


def _unknown(asked: dict, known: set[str], prefix: str) -> None:
    for key in asked:
        if key not in known:
            raise RealtimeError(f"Unknown parameter: '{prefix}{key}'.", "unknown_parameter", f"{prefix}{key}")


def _changes_ga(asked: dict) -> dict[str, Any]:
    known = {"instructions", "audio", "output_modalities", "max_output_tokens", "tools", "prompt", "specvox"}
    _unknown(asked, known | IGNORED_GA, "session.")
    if asked.get("type", "realtime") != "realtime":
        raise RealtimeError("only a realtime session is served here (no transcription session)", "invalid_value",
                            "session.type")
    changes = _common(asked, "session.")
    _modalities(asked.get("output_modalities"), "session.output_modalities")
    audio = _object(asked.get("audio", {}), "session.audio")
    _unknown(audio, {"input", "output"}, "session.audio.")
    audio_in = _object(audio.get("input", {}), "session.audio.input")
    audio_out = _object(audio.get("output", {}), "session.audio.output")
    _unknown(audio_in, {"format", "transcription", "turn_detection", "noise_reduction"}, "session.audio.input.")
    _unknown(audio_out, {"format", "voice", "speed"}, "session.audio.output.")
    if "format" in audio_in:
        changes["input_format"] = _format_ga(audio_in["format"], "session.audio.input.format")
    if "format" in audio_out:
        changes["output_format"] = _format_ga(audio_out["format"], "session.audio.output.format")
    if "transcription" in audio_in:
        changes.update(_transcription(audio_in["transcription"], "session.audio.input.transcription"))
    if "turn_detection" in audio_in:
        changes["turn_detection_raw"] = audio_in["turn_detection"]
    _none_or(audio_in.get("noise_reduction"), None, "session.audio.input.noise_reduction")
    _speed(audio_out.get("speed"), "session.audio.output.speed")
    if "voice" in audio_out:
        changes["voice"] = _voice(audio_out["voice"], "session.audio.output.voice")
    if "max_output_tokens" in asked:
        changes["max_output_tokens"] = _max_tokens(asked["max_output_tokens"], "session.max_output_tokens")
    return changes


def _changes_beta(asked: dict) -> dict[str, Any]:
    known = {"instructions", "modalities", "voice", "input_audio_format", "output_audio_format",
             "input_audio_transcription", "turn_detection", "tools", "temperature", "max_response_output_tokens",
             "input_audio_noise_reduction", "speed", "prompt", "specvox"}
    _unknown(asked, known | IGNORED_BETA, "session.")
    changes = _common(asked, "session.")
    _modalities(asked.get("modalities"), "session.modalities")
    for key, name in (("input_audio_format", "input_format"), ("output_audio_format", "output_format")):
        if key in asked:
            if asked[key] not in BETA_FORMATS:
                raise RealtimeError(f"{asked[key]!r} is not a format served here: {', '.join(BETA_FORMATS)}",
                                    "invalid_value", f"session.{key}")
            changes[name] = BETA_FORMATS[asked[key]]
    if "input_audio_transcription" in asked:
        changes.update(_transcription(asked["input_audio_transcription"], "session.input_audio_transcription"))
    if "turn_detection" in asked:
        changes["turn_detection_raw"] = asked["turn_detection"]
    _none_or(asked.get("input_audio_noise_reduction"), None, "session.input_audio_noise_reduction")
    _speed(asked.get("speed"), "session.speed")
    if "voice" in asked:
        changes["voice"] = _voice(asked["voice"], "session.voice")
    if "max_response_output_tokens" in asked:
        changes["max_output_tokens"] = _max_tokens(asked["max_response_output_tokens"],
                                                   "session.max_response_output_tokens")
    if "temperature" in asked:
        t = asked["temperature"]
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 2:
            raise RealtimeError("temperature must be a number from 0 to 2", "invalid_value", "session.temperature")
        changes["temperature"] = float(t)
    return changes


def _common(asked: dict, prefix: str) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if "instructions" in asked:
        changes["instructions"] = instructions_of(asked["instructions"], f"{prefix}instructions")
    if asked.get("tools"):
        raise RealtimeError("tools are not served here: specvox's model calls no functions", "unsupported_value",
                            f"{prefix}tools")
    _none_or(asked.get("prompt"), None, f"{prefix}prompt")
    if "specvox" in asked:
        changes.update(_specvox(_object(asked["specvox"], f"{prefix}specvox"), f"{prefix}specvox."))
    return changes


def _specvox(ext: dict, prefix: str) -> dict[str, Any]:
    """specvox's own settings (an extension object strict clients never send)."""
    _unknown(ext, {"extension_events", "drafter", "budget_ms", "mode", "choices"}, prefix)
    changes: dict[str, Any] = {}
    if "extension_events" in ext:
        changes["extension_events"] = bool(ext["extension_events"])
    if "drafter" in ext:
        if not isinstance(ext["drafter"], str):
            raise RealtimeError("drafter must be a string", "invalid_type", f"{prefix}drafter")
        changes["drafter"] = ext["drafter"]
    if "budget_ms" in ext:
        budget = ext["budget_ms"]
        if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget <= session_config.MAX_BUDGET_MS:
            raise RealtimeError(f"budget_ms must be 0-{session_config.MAX_BUDGET_MS}", "invalid_value",
                                f"{prefix}budget_ms")
        changes["budget_ms"] = budget
    if "mode" in ext:
        changes["mode"] = ext["mode"]
    return changes


def _object(value: Any, param: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError(f"{param} must be an object", "invalid_type", param)
    return value


def _none_or(value: Any, allowed: Any, param: str) -> None:
    if value is not None and value != allowed:
        raise RealtimeError(f"{param} is not supported here; leave it out or null", "unsupported_value", param)


def _speed(value: Any, param: str) -> None:
    if value is not None and value != 1 and value != 1.0:
        raise RealtimeError(f"{param}: only 1.0 is served (the voice speaks at its own rate)", "unsupported_value",
                            param)


def _modalities(value: Any, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, list) or "audio" not in value or not set(value) <= {"audio", "text"}:
        raise RealtimeError(f"{param}: specvox always speaks its replies, with their transcript: ['audio']",
                            "unsupported_value", param)


def _format_ga(value: Any, param: str) -> str:
    fmt = _object(value, param)
    kind = fmt.get("type")
    if kind not in FORMAT_RATE_HZ:
        raise RealtimeError(f"{kind!r} is not a format served here: {', '.join(FORMAT_RATE_HZ)}", "invalid_value",
                            f"{param}.type")
    if kind == PCM and fmt.get("rate", 24_000) != 24_000:
        raise RealtimeError("audio/pcm is 24000 Hz", "invalid_value", f"{param}.rate")
    return str(kind)


def _voice(value: Any, param: str) -> str:
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise RealtimeError(f"{param} must be a voice name", "invalid_type", param)
    return value


def _max_tokens(value: Any, param: str) -> int:
    if value in ("inf", None):
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= session_config.MAX_REPLY_TOKENS:
        raise RealtimeError(f"{param} must be 'inf' or 1-{session_config.MAX_REPLY_TOKENS}", "invalid_value", param)
    return value


def _transcription(value: Any, param: str) -> dict[str, Any]:
    """The asr transcribes every utterance whatever this says (turns need its words); null hides the transcripts."""
    if value is None:
        return {"transcribe": False}
    t = _object(value, param)
    language = t.get("language") or ""
    if not isinstance(language, str) or (language and not session_config.LANGUAGE.fullmatch(language)):
        raise RealtimeError(f"{param}.language must be an ISO 639-1 code such as 'en'", "invalid_value",
                            f"{param}.language")
    return {"transcribe": True, "transcription_language": language}


def _turn_detection(value: Any, session: RealtimeSession, asr: Any) -> TurnDetection | None:
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    td = _object(value, param)
    kind = td.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise RealtimeError(f"{kind!r}: server_vad, semantic_vad or null", "invalid_value", f"{param}.type")
    _unknown(td, {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                  "interrupt_response", "idle_timeout_ms", "eagerness"}, f"{param}.")
    flags = {}
    for flag in ("create_response", "interrupt_response"):
        value = td.get(flag)
        if value is not None and not isinstance(value, bool):
            raise RealtimeError(f"{flag} must be true or false", "invalid_type", f"{param}.{flag}")
        flags[flag] = value is not False
    _none_or(td.get("idle_timeout_ms"), None, f"{param}.idle_timeout_ms")
    effective = dict(threshold=asr.vad_threshold, prefix_padding_ms=asr.transcribe_pad_ms, **flags)
    if kind == "semantic_vad":
        eagerness = td.get("eagerness") or "auto"
        if eagerness not in EAGERNESS_WAIT:
            raise RealtimeError(f"eagerness {eagerness!r}: low, medium, high or auto", "invalid_value",
                                f"{param}.eagerness")
        return TurnDetection("semantic_vad", eagerness=eagerness, silence_duration_ms=asr.end_of_speech_silence_ms,
                             **effective)
    silence = td.get("silence_duration_ms")
    if silence is None:
        silence = 500
    if not isinstance(silence, int) or isinstance(silence, bool) or not 0 <= silence <= 10_000:
        raise RealtimeError("silence_duration_ms must be 0-10000", "invalid_value", f"{param}.silence_duration_ms")
    return TurnDetection("server_vad", silence_duration_ms=max(silence, asr.end_of_speech_silence_ms), **effective)


# ---- the session written back ---------------------------------------------------------------

def _turn_detection_out(td: TurnDetection | None) -> dict[str, Any] | None:
    if td is None:
        return None
    common_fields = {"type": td.type, "create_response": td.create_response,
                     "interrupt_response": td.interrupt_response}
    if td.type == "semantic_vad":
        return {**common_fields, "eagerness": td.eagerness}
    return {**common_fields, "threshold": td.threshold, "prefix_padding_ms": td.prefix_padding_ms,
            "silence_duration_ms": td.silence_duration_ms, "idle_timeout_ms": None}


def _transcription_out(session: RealtimeSession) -> dict[str, Any] | None:
    if not session.transcribe:
        return None
    return {"model": TRANSCRIPTION_MODEL, "language": session.transcription_language or None, "prompt": None}


def rendered(session: RealtimeSession, dialect: Dialect) -> dict[str, Any]:
    """The whole effective session as `session.created` / `session.updated` carry it."""
    tokens: int | str = session.max_output_tokens or "inf"
    ext = {"specvox": {"extension_events": session.extension_events, "drafter": session.drafter,
                       "budget_ms": session.budget_ms, "mode": session.mode}}
    if dialect == "beta":
        return {"id": session.session_id, "object": "realtime.session", "model": session.model,
                "modalities": ["audio", "text"], "instructions": session.instructions, "voice": session.voice,
                "input_audio_format": BETA_NAME[session.input_format],
                "output_audio_format": BETA_NAME[session.output_format],
                "input_audio_transcription": _transcription_out(session),
                "turn_detection": _turn_detection_out(session.turn_detection), "input_audio_noise_reduction": None,
                "tools": [], "tool_choice": "auto", "temperature": session.temperature or 0.0,
                "max_response_output_tokens": tokens, "speed": 1.0, "tracing": None, **ext}

    def fmt(name: str) -> dict[str, Any]:
        return {"type": name, "rate": FORMAT_RATE_HZ[name]} if name == PCM else {"type": name}

    return {"type": "realtime", "object": "realtime.session", "id": session.session_id, "model": session.model,
            "output_modalities": ["audio"], "instructions": session.instructions,
            "audio": {"input": {"format": fmt(session.input_format), "transcription": _transcription_out(session),
                                "noise_reduction": None, "turn_detection": _turn_detection_out(session.turn_detection)},
                      "output": {"format": fmt(session.output_format), "voice": session.voice, "speed": 1.0}},
            "tools": [], "tool_choice": "auto", "max_output_tokens": tokens, "tracing": None, "truncation": "auto",
            "prompt": None, "expires_at": 0, "include": None, **ext}
