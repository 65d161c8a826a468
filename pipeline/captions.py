"""Caption cues in the reply's timeline, written as WebVTT with webvtt-py."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import webvtt


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str


def vtt_timestamp(seconds: float) -> str:
    ms = max(0, round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def caption_text(text: str) -> str:
    """WebVTT cue text may hold neither blank lines nor the timing arrow."""
    return " ".join(text.split()).replace("-->", "->")


def to_webvtt_caption(cue: Cue) -> webvtt.Caption:
    return webvtt.Caption(vtt_timestamp(cue.start_s), vtt_timestamp(cue.end_s), caption_text(cue.text))


def webvtt_document(cues: Iterable[Cue]) -> str:
    vtt = webvtt.WebVTT(captions=[to_webvtt_caption(c) for c in cues])
    return vtt.content


def webvtt_block(cue: Cue) -> str:
    caption = to_webvtt_caption(cue)
    return f"{caption.start} --> {caption.end}\n{caption.text}\n"
