"""Cutting a growing reply into speakable phrases.

The first phrase goes out as soon as it is complete, at a clause boundary or a
length cap, because the first audio is what the listener waits for; later phrases
end at sentence boundaries, which sound more natural.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*\s|\n")
CLAUSE_END = re.compile(r"[,;:—–]\s|[.!?…]+[\"')\]]*\s|\n")
# A period after these is not a sentence end.
ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "e.g", "i.e", "no", "jr", "sr"})


@dataclass(frozen=True)
class PhraseOptions:
    first_phrase_min_chars: int = 12  # shorter clauses are joined to the next one
    first_phrase_max_chars: int = 36  # cut at a word boundary past this (about 8 tokens)
    # ... or after this many words, whichever comes first: the first audio waits for the first
    # phrase's last token, so "a few words" of it go out as soon as they are written. 0: no limit.
    first_phrase_max_words: int = 5
    max_phrase_chars: int = 220
    # A turn behind its latency budget cuts its first phrase after this many words (`hurry`).
    hurried_first_phrase_words: int = 3
    # ... once the first audio's deadline is this close (a first piece takes ~70-120 ms to make).
    hurry_before_deadline_ms: int = 250


class PhraseCutter:
    """Feed text deltas; take complete phrases as they form; `flush()` at the end."""

    def __init__(self, options: PhraseOptions = PhraseOptions()) -> None:
        self.options = options
        self._text = ""
        self._phrases_out = 0
        self.hurried = False

    @property
    def first_phrase_out(self) -> bool:
        return self._phrases_out > 0

    def hurry(self) -> bool:
        """The turn is late: cut the first phrase after a few words. True if it changed anything."""
        changed = not self.hurried and not self.first_phrase_out
        self.hurried = True
        return changed

    def feed(self, delta: str) -> list[str]:
        self._text += delta
        phrases = []
        while (cut := self._next_cut()) is not None:
            phrase, self._text = _tidy(self._text[:cut]), self._text[cut:]
            if _speakable(phrase):
                phrases.append(phrase)
                self._phrases_out += 1
        return phrases

    def flush(self) -> list[str]:
        phrase, self._text = _tidy(self._text), ""
        return [phrase] if _speakable(phrase) else []

    def _next_cut(self) -> int | None:
        first = self._phrases_out == 0
        pattern = CLAUSE_END if first else SENTENCE_END
        min_chars = self.options.first_phrase_min_chars if first and not self.hurried else 1
        for match in pattern.finditer(self._text):
            if match.end() >= min_chars and not _after_abbreviation(self._text, match.start()):
                return match.end()
        most_words = self.options.hurried_first_phrase_words if self.hurried else self.options.first_phrase_max_words
        if first and most_words:
            words = list(re.finditer(r"\S+\s", self._text))  # complete words: a space follows
            if len(words) >= most_words:
                return words[most_words - 1].end()
        cap = self.options.first_phrase_max_chars if first else self.options.max_phrase_chars
        if len(self._text) > cap:
            space = self._text.rfind(" ", 0, cap)
            return space + 1 if space > 0 else cap
        return None


def _after_abbreviation(text: str, dot: int) -> bool:
    """A period after an abbreviation, an initial or a list number ("2." at a line's start)."""
    if text[dot] != ".":
        return False
    before = text[:dot]
    word = before.rsplit(None, 1)[-1].lower() if before.strip() else ""
    prefix = before[: len(before) - len(word)].rstrip(" \t")
    line_start = prefix == "" or prefix.endswith("\n")
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()) or (word.isdigit() and line_start)


def _tidy(text: str) -> str:
    """One line, single spaces: a phrase is spoken and captioned as a line of text."""
    return " ".join(text.split())


def _speakable(phrase: str) -> bool:
    return any(ch.isalnum() for ch in phrase)
