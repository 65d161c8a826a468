"""Caption cues, written as WebVTT and SRT with webvtt-py: the reply's phrases and words, and the user's words."""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

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


def srt_document(cues: Iterable[Cue]) -> str:
    out = io.StringIO()
    webvtt.WebVTT(captions=[to_webvtt_caption(c) for c in cues]).write(out, format="srt")
    return out.getvalue()


@dataclass
class CaptionTrack:
    """A reply's cues as they are made: one per phrase, and one per word."""

    phrases: list[Cue] = field(default_factory=list)
    words: list[Cue] = field(default_factory=list)

    def documents(self) -> dict[str, str]:
        """WebVTT and SRT for both tracks, keyed phrases_webvtt, words_webvtt, phrases_srt, words_srt."""
        return {
            "phrases_webvtt": webvtt_document(self.phrases),
            "words_webvtt": webvtt_document(self.words),
            "phrases_srt": srt_document(self.phrases),
            "words_srt": srt_document(self.words),
        }


def webvtt_block(cue: Cue) -> str:
    caption = to_webvtt_caption(cue)
    return f"{caption.start} --> {caption.end}\n{caption.text}\n"


class TimedWord(Protocol):
    text: str
    start_s: float
    end_s: float


def cues_from_words(words: Iterable[TimedWord], max_chars: int = 42, max_pause_s: float = 0.7) -> list[Cue]:
    """Caption cues for spoken words: a new cue at a long pause or when a line would pass `max_chars`."""
    cues: list[Cue] = []
    line: list[TimedWord] = []
    for word in words:
        text = " ".join(w.text.strip() for w in [*line, word])
        if line and (len(text) > max_chars or word.start_s - line[-1].end_s > max_pause_s):
            cues.append(_cue(line))
            line = []
        line.append(word)
    return cues + ([_cue(line)] if line else [])


def _cue(words: list[TimedWord]) -> Cue:
    return Cue(words[0].start_s, max(words[-1].end_s, words[0].start_s), " ".join(w.text.strip() for w in words))
