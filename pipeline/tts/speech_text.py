"""What a phrase says aloud, word by word, next to what the caption shows.

A voice reads "1,200" or "Dr." as best its phonemizer can; saying them in words
first makes the speech predictable, and keeping each written word beside the
spoken words it became lets a caption word ("$1,200") span all of its audio
("one thousand two hundred dollars"). Numbers are written out with num2words.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from num2words import num2words

ABBREVIATIONS = {
    "dr.": "doctor", "mr.": "mister", "mrs.": "missus", "ms.": "miz", "prof.": "professor",
    "jr.": "junior", "sr.": "senior", "vs.": "versus", "etc.": "et cetera", "e.g.": "for example",
    "i.e.": "that is", "approx.": "approximately", "min.": "minutes", "no.": "number",
}
SYMBOLS = {"&": "and", "+": "plus", "=": "equals", "@": "at", "%": "percent", "#": "number", "°": "degrees",
           "/": "slash", "*": "star"}
CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
              "£": ("pound", "pounds", "penny", "pence")}
CLOCK_SUFFIXES = {"am": "A M", "a.m.": "A M", "pm": "P M", "p.m.": "P M"}

NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
TOKEN = re.compile(r"^(?P<lead>[\"'(\[«“‘]*)(?P<core>.*?)(?P<trail>[\"')\]»”’.,;:!?…]*)$")
MONEY = re.compile(rf"^(?P<sign>-?)(?P<cur>[$€£])(?P<num>{NUMBER})$")
PERCENT = re.compile(rf"^(?P<num>-?(?:{NUMBER}))%$")
ORDINAL = re.compile(r"^(?P<num>\d+)(?:st|nd|rd|th)$", re.IGNORECASE)
CLOCK = re.compile(r"^(?P<h>[01]?\d|2[0-3]):(?P<m>[0-5]\d)$")
YEAR = re.compile(r"^(?:1[1-9]|20)\d\d$")
PLAIN_NUMBER = re.compile(rf"^-?(?:{NUMBER})$")
DEGREES = re.compile(rf"^(?P<num>-?(?:{NUMBER}))°(?P<unit>[CF]?)$")


@dataclass(frozen=True)
class WrittenWord:
    text: str  # as the caption shows it
    spoken: tuple[str, ...]  # the words said for it, in order (punctuation kept for prosody)


@dataclass(frozen=True)
class SpeechText:
    words: tuple[WrittenWord, ...]

    @property
    def spoken(self) -> str:
        return " ".join(w for word in self.words for w in word.spoken)

    @property
    def spoken_words(self) -> list[str]:
        return [w for word in self.words for w in word.spoken]


def speech_text(phrase: str) -> SpeechText:
    """Each whitespace-separated word of `phrase` with what is said for it.

    Punctuation standing alone ("—", "...") joins the written word before it and says nothing.
    """
    tokens = phrase.split()
    words: list[WrittenWord] = []
    pending = ""  # punctuation before the first word
    for i, token in enumerate(tokens):
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        spoken = spoken_words(token, following)
        if not spoken:
            if words:
                words[-1] = WrittenWord(f"{words[-1].text} {token}", words[-1].spoken)
            else:
                pending = f"{pending} {token}".strip()
            continue
        words.append(WrittenWord(f"{pending} {token}".strip(), spoken))
        pending = ""
    return SpeechText(tuple(words))


def spoken_words(token: str, following: str = "") -> tuple[str, ...]:
    """What is said for one written word; empty for punctuation alone."""
    if token.lower() in ABBREVIATIONS:
        return tuple(ABBREVIATIONS[token.lower()].split())
    if token.lower() in CLOCK_SUFFIXES:
        return tuple(CLOCK_SUFFIXES[token.lower()].split())
    if token in SYMBOLS:
        return (SYMBOLS[token],)
    match = TOKEN.match(token)
    assert match is not None  # the pattern matches any string
    core, trail = match["core"], match["trail"]  # opening quotes and brackets are not said
    said = _say(core, following) if core else None
    if said is None:
        return (token,) if any(_is_speech(ch) for ch in token) else ()
    words = said.split()
    if trail.strip("'’"):  # the punctuation after it shapes the prosody
        words[-1] += trail.strip("'’")
    return tuple(words) if words else ()


def _say(core: str, following: str) -> str | None:
    """The spoken form of a number, amount, time or symbol; None to leave the word to the voice."""
    if m := MONEY.match(core):
        return ("minus " if m["sign"] else "") + _money(m["num"], CURRENCIES[m["cur"]])
    if m := PERCENT.match(core):
        return f"{_number(m['num'])} percent"
    if m := DEGREES.match(core):
        unit = {"C": " Celsius", "F": " Fahrenheit"}.get(m["unit"], "")
        return f"{_number(m['num'])} degrees{unit}"
    if m := ORDINAL.match(core):
        return _words(num2words(int(m["num"]), to="ordinal"))
    if m := CLOCK.match(core):
        return _clock(int(m["h"]), int(m["m"]), following.lower() in CLOCK_SUFFIXES)
    if YEAR.match(core) and not core.endswith("00"):
        return _words(num2words(int(core), to="year"))
    if PLAIN_NUMBER.match(core):
        return _number(core)
    return None


def _number(text: str) -> str:
    value = float(text.replace(",", "")) if "." in text else int(text.replace(",", ""))
    return _words(num2words(value))


def _money(text: str, names: tuple[str, str, str, str]) -> str:
    one, many, sub_one, sub_many = names
    units, _, fraction = text.replace(",", "").partition(".")
    main = f"{_number(units)} {one if int(units) == 1 else many}"
    cents = int((fraction + "00")[:2]) if fraction else 0
    if not cents:
        return main
    return f"{main} and {_number(str(cents))} {sub_one if cents == 1 else sub_many}"


def _clock(hours: int, minutes: int, has_suffix: bool) -> str:
    hour = _number(str(hours % 12 or 12) if has_suffix else str(hours))
    if minutes == 0:
        return hour if has_suffix else f"{hour} o'clock"
    return f"{hour} oh {_number(str(minutes))}" if minutes < 10 else f"{hour} {_number(str(minutes))}"


def _words(spelled: str) -> str:
    """num2words writes "one thousand, two hundred" and "twenty-four": one spoken word per word."""
    return " ".join(spelled.replace(",", " ").replace("-", " ").split())


def _is_speech(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "LN"
