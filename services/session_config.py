"""A session's configuration: checked field by field, defaults filled in, overrides merged.

The gateway stores the resolved `SessionConfig` with the session (as JSON in its Redis hash)
and merges a stream's `StreamStart.overrides` over it: a zero or empty field there keeps
the session's value. Every unknown or out-of-range value is a ValueError naming the field
(INVALID_ARGUMENT to the client).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from google.protobuf import json_format

from pipeline.llm.options import SamplingOptions
from services.protos import load

pb, _ = load("gateway")
Config = pb.SessionConfig
MAX_SYSTEM_PROMPT_CHARS = 8_000
MAX_REPLY_TOKENS = 1_024
MAX_BUDGET_MS = 60_000
MIN_RATE_HZ, MAX_RATE_HZ = 8_000, 48_000
LANGUAGE = re.compile(r"[a-z]{2,3}")
MAX_BACKCHANNELS, MAX_BACKCHANNEL_CHARS, MAX_BACKCHANNEL_WORDS = 64, 40, 10


@dataclass(frozen=True)
class Choices:
    """What the services offer, as they said (Llm.Capabilities, Tts.Capabilities)."""

    drafters: tuple[str, ...]
    voices: tuple[str, ...]
    default_drafter: str
    default_voice: str
    max_new_tokens: int


def merged(base: Config, overrides: Config) -> Config:
    """`base` with every field `overrides` sets (non-zero, non-empty, or a present message)."""
    out = Config()
    out.CopyFrom(base)
    for field, value in overrides.ListFields():  # only fields that are set
        if field.is_repeated:
            getattr(out, field.name)[:] = value
        elif field.message_type is not None:
            getattr(out, field.name).CopyFrom(value)
        else:
            setattr(out, field.name, value)
    return out


def resolve(config: Config, choices: Choices, default_budget_ms: int) -> Config:
    """The config as it will be used: checked, with the defaults filled in."""
    check(config, choices)
    out = Config()
    out.CopyFrom(config)
    out.voice = out.voice or choices.default_voice
    out.drafter = out.drafter or choices.default_drafter
    out.max_reply_tokens = out.max_reply_tokens or choices.max_new_tokens
    out.budget_ms = out.budget_ms or default_budget_ms
    out.mode = out.mode or Config.DIALOGUE
    if not out.caption_formats:
        out.caption_formats.append(Config.WEBVTT)
    return out


def check(c: Config, choices: Choices) -> None:
    def bad(field: str, message: str) -> None:
        raise ValueError(f"config.{field}: {message}")

    if len(c.system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
        bad("system_prompt", f"{len(c.system_prompt)} characters; at most {MAX_SYSTEM_PROMPT_CHARS}")
    if c.voice and c.voice not in choices.voices:
        bad("voice", f"unknown voice {c.voice!r}; choose one of {', '.join(choices.voices)}")
    if c.drafter and c.drafter not in choices.drafters:
        bad("drafter", f"unknown drafter {c.drafter!r}; choose one of {', '.join(choices.drafters)}")
    if c.HasField("sampling"):
        s = c.sampling
        try:
            SamplingOptions(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                            repetition_penalty=s.repetition_penalty or 1.0).validate()
        except ValueError as e:
            bad("sampling", str(e))
    if c.max_reply_tokens > MAX_REPLY_TOKENS:
        bad("max_reply_tokens", f"{c.max_reply_tokens}; at most {MAX_REPLY_TOKENS}")
    if c.budget_ms > MAX_BUDGET_MS:
        bad("budget_ms", f"{c.budget_ms} ms; at most {MAX_BUDGET_MS}")
    if c.mode not in Config.Mode.values():
        bad("mode", f"unknown mode {c.mode}; DIALOGUE or CAPTION")
    for f in c.caption_formats:
        if f not in Config.CaptionFormat.values() or f == Config.CAPTION_FORMAT_UNSPECIFIED:
            bad("caption_formats", f"unknown caption format {f}; WEBVTT or SRT")
    if c.reply_sample_rate_hz and not MIN_RATE_HZ <= c.reply_sample_rate_hz <= MAX_RATE_HZ:
        bad("reply_sample_rate_hz", f"{c.reply_sample_rate_hz} Hz is outside {MIN_RATE_HZ}-{MAX_RATE_HZ}")
    if c.language and not LANGUAGE.fullmatch(c.language):
        bad("language", f"{c.language!r} is not an ISO 639-1 code such as 'en'")
    if len(c.backchannels) > MAX_BACKCHANNELS:
        bad("backchannels", f"{len(c.backchannels)} entries; at most {MAX_BACKCHANNELS}")
    for b in c.backchannels:
        if not b.strip() or len(b) > MAX_BACKCHANNEL_CHARS:
            bad("backchannels", f"{b!r}: each entry is 1-{MAX_BACKCHANNEL_CHARS} characters")
    if c.backchannel_max_words > MAX_BACKCHANNEL_WORDS:
        bad("backchannel_max_words", f"{c.backchannel_max_words}; at most {MAX_BACKCHANNEL_WORDS}")


def backchannels(c: Config, default: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(b.strip().lower() for b in c.backchannels) or default


def to_json(c: Config) -> str:
    return json_format.MessageToJson(c, indent=None)


def from_json(text: str) -> Config:
    return json_format.Parse(text, Config()) if text else Config()
