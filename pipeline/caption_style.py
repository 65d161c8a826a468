"""Broadcast-style caption cues from timed words, and a checker that reports each style rule on its own.

Every rule is a `CueStyle` setting whose default is a public style guide's, read from the guide's published text:

- Netflix, "Timed Text Style Guide: General Requirements" (partnerhelp.netflixstudios.com, article 215758617):
  a subtitle event lasts 5/6 s ("20 frames for 24fps") to 7 s; "2 frames minimum (regardless of frame rate)"
  between events; 2 lines at most, and one line unless the text exceeds the line's limit; a line broken after
  punctuation, before conjunctions, before prepositions, and never between an article or an adjective and its
  noun, a first and a last name, a subject pronoun and its verb, a verb and its auxiliary or negation.
- Netflix, "English Template Timed Text Style Guide" (article 219375728): 42 characters a line; reading speed
  17 characters a second for adult programmes, 13 for children's.
- BBC Subtitle Guidelines (bbc.github.io/subtitle-guidelines): 3.4 break at natural points (not an article from
  its noun, a preposition or a conjunction from what follows, a pronoun from its verb, the parts of a complex
  verb); 3.9 a long sentence segmented over subtitles at clause, then major phrase, boundaries; 3.10 timing
  matters more than line breaks; 5.1 a subtitle appears when its speech starts.
- DCMP Captioning Key, "Line Division" (captioningkey.org; its list as Syracuse University's captioning
  guidelines quote it): a sentence broken where speech pauses; never break a person's name or a title from it,
  nor a line after a conjunction; never end a sentence and begin another on one line unless they are short.

The order of precedence where rules conflict, highest first (`broadcast_cues` scores each way to cut an utterance
into cues and lines by it, and takes the best):

1. Timing that never runs ahead of speech: a cue starts when its first word is spoken (later only where the cue
   before it, in overlapping or jammed speech, needs the frame gap), cues follow one another at least the frame
   gap apart, and each utterance starts a new cue.
2. Layout: at most `max_lines` lines of at most `max_line_chars`. A word longer than a line takes a line of its
   own (reported by `style_violations`, never hidden).
3. Maximum duration: a cue never shows longer than `max_duration_s`; words spoken over longer are cut into cues.
4. A name or a number is never split over lines or cues (unless it cannot fit a line, or a cue, or is said over
   longer than a cue may show).
5. Minimum duration and reading speed: a cue stays up after its last word as long as they need, up to the next
   cue's start less the frame gap; where that is not enough the utterance is cut differently (more or fewer words
   a cue); where nothing is enough (speech faster than the reading speed) the cue is reported.
6. Line and cue breaks at clause and phrase boundaries (the guides' lists above; a long pause counts as one).
7. Shape: lines of similar length, a shorter top line where there is a choice (the bottom-heavy shape of the
   BBC's examples in 3.4 and 3.9; none of the four guides states it as a rule).

Times are whole milliseconds, the resolution of WebVTT and SRT; a word's time is rounded up, never earlier.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import NamedTuple

from pipeline.captions import Cue, TimedWord

CHILDREN_CHARS_PER_S = 13.0  # Netflix English Template TTSG: children's programmes


@dataclass(frozen=True)
class CueStyle:
    """The rules a cue keeps; defaults from the guides named in this module's docstring."""

    max_line_chars: int = 42  # Netflix English Template TTSG, "Character Limitation"
    max_lines: int = 2  # Netflix General Requirements, "Line Treatment"; BBC 3.3
    max_chars_per_s: float = 17.0  # Netflix English Template TTSG, adults (13 for children's programmes)
    min_duration_s: float = 5 / 6  # Netflix General Requirements, "Duration"
    max_duration_s: float = 7.0  # Netflix General Requirements, "Duration"
    min_gap_frames: int = 2  # Netflix General Requirements, "Frame Gap", whatever the frame rate
    frame_rate: float = 24.0  # the rate of Netflix's own example ("20 frames for 24fps"); BBC broadcast is 25

    def __post_init__(self) -> None:
        if self.max_line_chars < 1 or self.max_lines < 1 or self.min_gap_frames < 0:
            raise ValueError("max_line_chars and max_lines must be at least 1, min_gap_frames at least 0")
        if self.max_chars_per_s <= 0 or self.frame_rate <= 0:
            raise ValueError("max_chars_per_s and frame_rate must be positive")
        if not 0 < self.min_duration_s <= self.max_duration_s:
            raise ValueError("durations must satisfy 0 < min_duration_s <= max_duration_s")

    @classmethod
    def children(cls) -> CueStyle:
        """The guides' rules for children's programmes: 13 characters a second."""
        return cls(max_chars_per_s=CHILDREN_CHARS_PER_S)

    @property
    def min_gap_s(self) -> float:
        return self.min_gap_frames / self.frame_rate

    @property
    def _gap_ms(self) -> int:
        return math.ceil(self.min_gap_frames * 1000 / self.frame_rate - 1e-9)

    @property
    def _min_ms(self) -> int:
        return math.ceil(self.min_duration_s * 1000 - 1e-9)

    @property
    def _max_ms(self) -> int:
        return math.floor(self.max_duration_s * 1000 + 1e-9)


# Words by the part they play in a phrase: enough to find the guides' good and bad breaks without a parser.
ARTICLES = frozenset({"a", "an", "the"})
DETERMINERS = frozenset({"this", "these", "those", "my", "your", "his", "its", "our", "their", "every", "each",
                         "another", "either", "neither", "whose"})
PREPOSITIONS = frozenset({
    "about", "above", "across", "after", "against", "along", "among", "around", "at", "before", "behind", "below",
    "beneath", "beside", "besides", "between", "beyond", "by", "despite", "down", "during", "except", "for", "from",
    "in", "inside", "into", "like", "near", "of", "off", "on", "onto", "out", "outside", "over", "past", "per",
    "since", "through", "throughout", "till", "to", "toward", "towards", "under", "underneath", "until", "up",
    "upon", "via", "with", "within", "without"})
CONJUNCTIONS = frozenset({
    "and", "but", "or", "nor", "so", "yet", "because", "although", "though", "while", "whereas", "if", "unless",
    "when", "whenever", "where", "wherever", "whether", "that", "which", "who", "whom", "than", "as", "once"})
SUBJECT_PRONOUNS = frozenset({"i", "you", "he", "she", "it", "we", "they"})
AUXILIARIES = frozenset({
    "am", "is", "are", "was", "were", "be", "been", "being", "have", "has", "had", "do", "does", "did", "will",
    "would", "shall", "should", "can", "could", "may", "might", "must", "isn't", "aren't", "wasn't", "weren't",
    "haven't", "hasn't", "hadn't", "don't", "doesn't", "didn't", "won't", "wouldn't", "shan't", "shouldn't",
    "can't", "couldn't", "mightn't", "mustn't"})
NEGATIONS = frozenset({"not", "never"})
ADJECTIVES = frozenset({
    "good", "new", "old", "great", "big", "small", "little", "long", "short", "young", "high", "low", "large",
    "bad", "best", "better", "worse", "worst", "own", "other", "same", "different", "important", "whole", "real",
    "full", "free", "true", "hard", "easy", "strong", "clear", "dark", "light", "happy", "nice", "huge", "tiny",
    "black", "white", "red", "blue", "green", "yellow", "brown", "grey", "gray", "cold", "hot", "warm", "cool",
    "early", "late", "next", "last", "few", "many", "much", "more", "most", "several", "friendly", "lovely",
    "pretty", "quick", "slow", "fast", "beautiful", "special", "local", "main", "certain", "public", "private"})
_ADJECTIVE_SUFFIXES = ("ful", "ous", "ive", "able", "ible", "less", "ical")
FUNCTION_WORDS = ARTICLES | DETERMINERS | PREPOSITIONS | CONJUNCTIONS | SUBJECT_PRONOUNS | AUXILIARIES | NEGATIONS

NUMBER_WORDS = frozenset({
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty",
    "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "million", "billion", "trillion"})
_TENS = frozenset({"twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"})
_UNIT_ORDINALS = frozenset({"first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"})
_SCALES = frozenset({"hundred", "thousand", "million", "billion", "trillion"})
# What an amount is said with: the number and it are one unit (Oxford style: a number is not separated from its unit).
NUMBER_UNITS = frozenset({
    "dollars", "dollar", "cents", "cent", "percent", "%", "euros", "euro", "pounds", "pound", "pence",
    "am", "pm", "a.m", "p.m", "o'clock", "kg", "km", "cm", "mm", "mph", "kph", "lb", "lbs", "bucks"})
_CURRENCY_SIGNS = frozenset("$€£¥")

TITLES = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "sir", "madam", "mx", "rev", "gen", "capt", "sgt"})
_I_FORMS = frozenset({"i", "i'm", "i'll", "i've", "i'd", "i’m", "i’ll", "i’ve", "i’d"})
_CLOSERS = "\"'”’»)]}"
_OPENERS = "\"'“‘«([{"
_SENTENCE_END = re.compile(r"[.!?…]$")
_CLAUSE_END = re.compile(r"[,;:—–-]$")
_ABBREVIATION = re.compile(r"^(?:[A-Za-z]\.){2,}$|^[A-Za-z]{1,4}\.$")


def bare(text: str) -> str:
    """A word without the punctuation around it, in lower case."""
    return text.strip(_OPENERS + _CLOSERS + ".,;:!?…—–").lower()


def _tail(text: str) -> str:
    return text.rstrip(_CLOSERS)


def _is_abbreviation(text: str) -> bool:
    """A full stop that ends an abbreviation ("Dr.", "U.S.", "a.m."), not a sentence."""
    word = _tail(text).lstrip(_OPENERS)
    return bool(_ABBREVIATION.match(word)) and (bare(word) in TITLES or word.count(".") > 1)


def ends_sentence(text: str) -> bool:
    return bool(_SENTENCE_END.search(_tail(text))) and not _is_abbreviation(text)


def _ends_with_punctuation(text: str) -> bool:
    return bool(_SENTENCE_END.search(_tail(text)) or _CLAUSE_END.search(_tail(text)))


def _capitalised(text: str) -> bool:
    word = text.lstrip(_OPENERS)
    return bool(word) and word[0].isupper() and bare(word) not in _I_FORMS


def _numeric(text: str) -> bool:
    """Digits ("25", "$25", "3:30", "1,000"), a currency sign alone, or number words ("twenty", "twenty-five")."""
    word = bare(text)
    if any(c.isdigit() for c in word) or (word and all(c in _CURRENCY_SIGNS for c in word)):
        return True
    parts = word.split("-")
    return bool(word) and all(p in NUMBER_WORDS for p in parts)


def _number_link(texts: Sequence[str], k: int) -> bool:
    """Words k and k + 1 belong to one number or amount ("twenty five", "$ 25", "5 percent", "hundred and five")."""
    a, b = bare(texts[k]), bare(texts[k + 1])
    if _numeric(texts[k]) and (_numeric(texts[k + 1]) or b in NUMBER_UNITS):
        return True
    if a in _TENS and b in _UNIT_ORDINALS:  # "twenty first"
        return True
    joiners = {"and": _SCALES, "point": None}
    if b in joiners and k + 2 < len(texts) and _numeric(texts[k + 2]) and not _ends_with_punctuation(texts[k + 1]):
        before = joiners[b]
        return _numeric(texts[k]) if before is None else a in before
    if a in joiners and k > 0 and _numeric(texts[k + 1]) and not _ends_with_punctuation(texts[k - 1]):
        before = joiners[a]
        prev = bare(texts[k - 1])
        return _numeric(texts[k - 1]) if before is None else prev in before
    return False


def unit_links(texts: Sequence[str]) -> list[str | None]:
    """For each pair of neighbouring words, "name" or "number" where they are one unit that no break may split,
    else None. A name: capitalised words in a row, the first not at a sentence's start (its capital says
    nothing), or a title and the name after it; a number: digits, number words and what an amount is said with."""
    links: list[str | None] = [None] * max(0, len(texts) - 1)
    sentence_start = True
    for k in range(len(texts) - 1):
        here, after = texts[k], texts[k + 1]
        title = bare(here) in TITLES and _capitalised(after)
        if _ends_with_punctuation(here) and not (title and _is_abbreviation(here)):
            sentence_start = ends_sentence(here)
            continue
        if _number_link(texts, k):
            links[k] = "number"
        elif title or (_capitalised(here) and _capitalised(after) and not sentence_start):
            links[k] = "name"
        sentence_start = False
    return links


def _adjective(word: str) -> bool:
    return word in ADJECTIVES or (len(word) >= 6 and word.endswith(_ADJECTIVE_SUFFIXES))


# Costs of a way to cut an utterance, by the order of precedence in the module's docstring.
SPAN_OVER_MAX = 1e7  # words spoken over longer than a cue may show, in one cue
UNIT_SPLIT = 1e5  # a name or a number split over lines (CUE_BREAK times that over cues)
TIMING = 1e3  # under the minimum duration or over the reading speed: up to twice this by how far, so the least
# bad wins, and a cue's worst is far below a split name
ARTICLE_BREAK = 50.0  # a break after an article
LOOSE_BREAK = 20.0  # after a determiner, a preposition or a conjunction
VERB_BREAK = 15.0  # a subject pronoun or an auxiliary from its verb, a verb from its negation
ADJECTIVE_BREAK = 10.0  # after a likely adjective, before a likely noun
PLAIN_BREAK = 5.0  # between two words with nothing said for it
PHRASE_BREAK = 2.0  # before a conjunction or a preposition
CLAUSE_BREAK = 1.0  # after a comma, a colon, a dash, or at a pause
BALANCE = 4.0  # per line's width of difference between two lines' lengths (linguistics first: BBC 3.4)
TOP_HEAVY = 1.0  # a top line longer than the one below
PER_CUE = 3.0  # each cue: fewer, fuller cues where nothing else decides
CUE_BREAK = 2.0  # a break between cues costs this many times one between lines: a cue is read apart (BBC 3.2, 3.9)
PAUSE_MS = 500  # a pause this long between words counts as a clause boundary
SENTENCE_INSIDE = 4.0  # a sentence of three words or more ending inside a line, another going on after it


def break_cost(texts: Sequence[str], k: int, links: Sequence[str | None], pause_ms: int = 0) -> float:
    """What a line or cue break between words k and k + 1 costs (0: after a sentence)."""
    if links[k]:
        return UNIT_SPLIT
    if ends_sentence(texts[k]):
        return 0.0
    if _ends_with_punctuation(texts[k]):
        return CLAUSE_BREAK
    here, after = bare(texts[k]), bare(texts[k + 1])
    if here in ARTICLES:
        return ARTICLE_BREAK
    if pause_ms >= PAUSE_MS:
        return CLAUSE_BREAK
    if after in CONJUNCTIONS or after in PREPOSITIONS:
        return PHRASE_BREAK
    if here in DETERMINERS or here in PREPOSITIONS or here in CONJUNCTIONS:
        return LOOSE_BREAK
    if here in SUBJECT_PRONOUNS or here in AUXILIARIES or after in NEGATIONS or after.startswith("n't"):
        return VERB_BREAK
    if _adjective(here) and after not in FUNCTION_WORDS:
        return ADJECTIVE_BREAK
    return PLAIN_BREAK


def shape_cost(lengths: Sequence[int], max_line_chars: int) -> float:
    """Lines of similar length, each no longer than the one below it."""
    cost = 0.0
    for top, below in pairwise(lengths):
        cost += BALANCE * abs(top - below) / max_line_chars + (TOP_HEAVY if top > below else 0.0)
    return cost


@dataclass(frozen=True)
class _Word:
    text: str
    start_ms: int
    end_ms: int


@dataclass
class _Draft:
    """A cue as the segmentation chose it, before the pass that keeps all cues in order."""

    words: list[_Word]
    lines: tuple[str, ...]
    limit_ms: int | None  # the latest it may end: the next cue's start less the gap (None: no next cue)
    utterance: int


def _timeline(utterances: Sequence[Sequence[TimedWord]]) -> list[tuple[int, list[_Word]]]:
    """Each utterance's words (text trimmed, empty ones dropped) in whole ms rounded up, starts never going back,
    no word ending before it starts; utterances by their first word's start, each with its index in the input."""
    out: list[tuple[int, list[_Word]]] = []
    for index, utterance in enumerate(utterances):
        words: list[_Word] = []
        for w in utterance:
            text = " ".join(w.text.split())
            if not text:
                continue
            start = max(0, math.ceil(w.start_s * 1000 - 1e-6))
            start = max(start, words[-1].start_ms) if words else start
            words.append(_Word(text, start, max(start, math.ceil(w.end_s * 1000 - 1e-6))))
        if words:
            out.append((index, words))
    out.sort(key=lambda item: item[1][0].start_ms)
    return out


def _layouts(widths: Sequence[int], max_lines: int, max_chars: int) -> Iterator[list[int]]:
    """Each way to set words of these widths on at most `max_lines` lines of at most `max_chars`, as the indices
    of the words that start the second and later lines; one line only, if the words fit on one. A word longer
    than a line takes a line of its own (the one line that may be longer)."""
    n = len(widths)
    if sum(widths) + n - 1 <= max_chars:
        yield []
        return

    def rest(start: int, lines_left: int) -> Iterator[list[int]]:
        length = -1
        for end in range(start, n):
            length += widths[end] + 1
            if length > max_chars and end > start:
                return
            if end == n - 1:
                yield []
            elif lines_left > 1:
                for tail in rest(end + 1, lines_left - 1):
                    yield [end + 1, *tail]
            if length > max_chars:
                return

    yield from rest(0, max_lines)


def _best_lines(texts: Sequence[str], breaks: Sequence[float], inside: Sequence[float],
                style: CueStyle) -> tuple[float, list[int]] | None:
    """The cheapest layout of the words (breaks[k]: a break after word k; inside[k]: word k not at a line's end),
    or None where none fits."""
    widths = [len(t) for t in texts]
    ends = [0, *accumulate(w + 1 for w in widths)]  # a line of words a..b-1 is ends[b] - ends[a] - 1 long
    within = sum(inside[:-1])
    best: tuple[float, list[int]] | None = None
    for starts in _layouts(widths, style.max_lines, style.max_line_chars):
        bounds = [0, *starts, len(texts)]
        lengths = [ends[b] - ends[a] - 1 for a, b in pairwise(bounds)]
        cost = sum(breaks[s - 1] - inside[s - 1] for s in starts) + within + shape_cost(lengths, style.max_line_chars)
        if best is None or cost < best[0]:
            best = (cost, starts)
    return best


def _sentences_inside(texts: Sequence[str]) -> list[float]:
    """What each word costs where a line goes on after it: a sentence of three words or more ending there (DCMP
    Captioning Key, "Line Division": never end a sentence and begin another on one line unless they are short)."""
    costs = [0.0] * len(texts)
    begun = 0
    for k, text in enumerate(texts):
        if ends_sentence(text):
            costs[k] = SENTENCE_INSIDE if k - begun + 1 > 2 else 0.0
            begun = k + 1
    return costs


def _end_ms(start: int, chars: int, last_end: int, limit: int | None, style: CueStyle) -> int:
    """When a cue ends: after its last word, and after the minimum duration and its reading time, but no later
    than the maximum duration or `limit`; at least 1 ms after it starts."""
    reading = math.ceil(chars * 1000 / style.max_chars_per_s - 1e-9)
    end = min(max(last_end, start + style._min_ms, start + reading), start + style._max_ms)
    if limit is not None:
        end = min(end, limit)
    return max(end, start + 1)


def _timing_cost(start: int, end: int, chars: int, last_end: int, style: CueStyle) -> float:
    duration = end - start
    cost = SPAN_OVER_MAX if last_end - start > style._max_ms else 0.0
    if duration < style._min_ms:
        cost += TIMING * (1 + (style._min_ms - duration) / style._min_ms)
    if chars * 1000 > style.max_chars_per_s * duration:
        cost += TIMING * (1 + min(1.0, chars * 1000 / (style.max_chars_per_s * duration) - 1))
    return cost


def _segment(words: list[_Word], limit: int | None, style: CueStyle, utterance: int) -> list[_Draft]:
    """The utterance cut into cues and lines at the least total cost (dynamic programming over where cues end:
    a cue's time runs from its first word to the next cue's first word, so its cost depends on it alone)."""
    texts = [w.text for w in words]
    n = len(words)
    links = unit_links(texts)
    breaks = [break_cost(texts, k, links, words[k + 1].start_ms - words[k].end_ms) for k in range(n - 1)]
    inside = _sentences_inside(texts)
    gap = style._gap_ms
    best = [math.inf] * (n + 1)
    best[0] = 0.0
    choice: list[tuple[int, list[int]]] = [(0, [])] * (n + 1)
    for i in range(n):
        chars, last_end = -1, 0
        for j in range(i, n):
            chars += len(texts[j]) + 1
            last_end = max(last_end, words[j].end_ms)
            layout = _best_lines(texts[i:j + 1], breaks[i:j], inside[i:j + 1], style)
            if layout is None:
                break
            start = words[i].start_ms
            cue_limit = words[j + 1].start_ms - gap if j + 1 < n else limit
            end = _end_ms(start, chars, last_end, cue_limit, style)
            cost = best[i] + layout[0] + _timing_cost(start, end, chars, last_end, style) + PER_CUE
            if j + 1 < n:  # a break costs more between cues than between lines (a name that fits a cue stays in it)
                cost += breaks[j] * CUE_BREAK
            if cost < best[j + 1]:
                best[j + 1] = cost
                choice[j + 1] = (i, layout[1])
    drafts: list[_Draft] = []
    j = n
    while j > 0:
        i, starts = choice[j]
        bounds = [0, *starts, j - i]
        lines = tuple(" ".join(texts[i + a:i + b]) for a, b in pairwise(bounds))
        cue_limit = words[j].start_ms - gap if j < n else limit
        drafts.append(_Draft(words[i:j], lines, cue_limit, utterance))
        j = i
    return drafts[::-1]


def broadcast_cues(utterances: Sequence[Sequence[TimedWord]], style: CueStyle = CueStyle()) -> list[Cue]:
    """Cues for timed words, one utterance (a list of words: ASR words, align_caption's cues, gRPC Words) after
    another, by `style`'s rules and the order of precedence in this module's docstring. Each cue has its `lines`,
    `text` (the lines joined by spaces), the words in it with their spoken times (`words`), and the index of its
    utterance in the input (`utterance`). Empty input: no cues."""
    timeline = _timeline(utterances)
    drafts: list[_Draft] = []
    for n, (index, words) in enumerate(timeline):
        limit = None
        if n + 1 < len(timeline):
            following = timeline[n + 1][1][0].start_ms
            # Overlapping speech: the next utterance waits for this one instead of cutting it short.
            limit = following - style._gap_ms if following > words[-1].start_ms else None
        drafts += _segment(words, limit, style, index)
    cues: list[Cue] = []
    previous_end: int | None = None
    for draft in drafts:
        start = draft.words[0].start_ms
        if previous_end is not None:
            start = max(start, previous_end + style._gap_ms)
        chars = len(" ".join(draft.lines))
        last_end = max(w.end_ms for w in draft.words)
        end = _end_ms(start, chars, last_end, draft.limit_ms, style)
        previous_end = end
        cues.append(Cue(start / 1000, end / 1000, " ".join(draft.lines), lines=draft.lines,
                        words=tuple(Cue(w.start_ms / 1000, w.end_ms / 1000, w.text) for w in draft.words),
                        utterance=draft.utterance))
    return cues


class Violation(NamedTuple):
    """One rule a cue breaks: `rule` is one of RULES, `cue` the cue's index."""

    rule: str
    cue: int
    detail: str

    def __str__(self) -> str:
        return f"cue {self.cue}: {self.rule}: {self.detail}"


RULES = ("order", "gap", "lines", "line length", "min duration", "max duration", "reading speed", "early",
         "name split", "number split", "article break")
_TOLERANCE_S = 1e-6  # float noise only: times kept in whole ms round a limit up (834 ms for 5/6 s)


def find_violations(cues: Sequence[Cue], style: CueStyle = CueStyle()) -> list[Violation]:
    """Every rule each cue breaks, each rule checked on its own (a cue that cannot be fixed, such as a word longer
    than a line, is reported like any other). Names, numbers and article breaks are read from the cues' lines
    within each utterance (consecutive cues with the same `utterance`)."""
    found: list[Violation] = []
    for n, cue in enumerate(cues):
        found += _timing_violations(n, cue, cues[n - 1] if n else None, style)
        lines = cue.shown_lines
        if len(lines) > style.max_lines:
            found.append(Violation("lines", n, f"{len(lines)} lines, over {style.max_lines}"))
        for k, line in enumerate(lines):
            if len(line) > style.max_line_chars:
                found.append(Violation("line length", n, f"line {k + 1} has {len(line)} characters, "
                                                         f"over {style.max_line_chars}: {line!r}"))
    first = 0
    for n in range(1, len(cues) + 1):
        if n == len(cues) or cues[n].utterance != cues[first].utterance:
            found += _break_violations(cues, first, n)
            first = n
    return sorted(found, key=lambda v: (v.cue, RULES.index(v.rule)))


def style_violations(cues: Sequence[Cue], style: CueStyle = CueStyle()) -> list[str]:
    """`find_violations`, as sentences ("cue 3: reading speed: ..."); [] when every cue keeps every rule."""
    return [str(v) for v in find_violations(cues, style)]


def _timing_violations(n: int, cue: Cue, previous: Cue | None, style: CueStyle) -> list[Violation]:
    found: list[Violation] = []
    duration = cue.end_s - cue.start_s
    if duration <= 0:
        found.append(Violation("order", n, f"ends at {cue.end_s:.3f} s, not after its start {cue.start_s:.3f} s"))
    if previous is not None:
        if cue.start_s < previous.start_s:
            found.append(Violation("order", n, f"starts at {cue.start_s:.3f} s, before the cue before it"))
        gap = cue.start_s - previous.end_s
        if gap < style.min_gap_s - _TOLERANCE_S:
            found.append(Violation("gap", n, f"{gap * 1000:.0f} ms after the cue before it, under "
                                             f"{style.min_gap_frames} frames at {style.frame_rate:g} fps"))
    if duration < style.min_duration_s - _TOLERANCE_S:
        found.append(Violation("min duration", n, f"{duration:.3f} s, under {style.min_duration_s:.3f} s"))
    if duration > style.max_duration_s + _TOLERANCE_S:
        found.append(Violation("max duration", n, f"{duration:.3f} s, over {style.max_duration_s:g} s"))
    chars = len(" ".join(cue.shown_lines))
    if chars > style.max_chars_per_s * max(duration, 0.0) + 1e-9:
        speed = f"{chars / duration:.1f}" if duration > 0 else "unbounded"
        found.append(Violation("reading speed", n, f"{speed} characters a second, over {style.max_chars_per_s:g}"))
    if cue.words and cue.start_s < cue.words[0].start_s - _TOLERANCE_S:
        found.append(Violation("early", n, f"shown at {cue.start_s:.3f} s, before its first word is spoken "
                                           f"at {cue.words[0].start_s:.3f} s"))
    return found


def _break_violations(cues: Sequence[Cue], first: int, stop: int) -> list[Violation]:
    """Names and numbers split, and lines ending in an article, within cues[first:stop] (one utterance)."""
    tokens: list[str] = []
    line_ends: list[tuple[int, int]] = []  # (index of the last word of a line, cue)
    cue_ends: list[tuple[int, int]] = []
    for n in range(first, stop):
        lines = cues[n].shown_lines
        for k, line in enumerate(lines):
            tokens += line.split()
            if k + 1 < len(lines):
                line_ends.append((len(tokens) - 1, n))
        if n + 1 < stop:
            cue_ends.append((len(tokens) - 1, n))
    links = unit_links(tokens)
    found: list[Violation] = []
    for where, ends in (("line", line_ends), ("cue", cue_ends)):
        for k, n in ends:
            if 0 <= k < len(links) and links[k]:
                found.append(Violation(f"{links[k]} split", n, f"{tokens[k]!r} | {tokens[k + 1]!r} across a {where}"))
    for k, n in line_ends:
        if 0 <= k < len(tokens) and bare(tokens[k]) in ARTICLES and not _ends_with_punctuation(tokens[k]):
            found.append(Violation("article break", n, f"a line ends with the article {tokens[k]!r}"))
    return found


def placed_after(cues: Sequence[Cue], earliest_s: float, style: CueStyle = CueStyle()) -> list[Cue]:
    """Live captions: one utterance's cues, made before the next utterance was heard, moved no earlier than
    `earliest_s` (the last cue sent's end plus the gap), each kept apart from the one before it by the gap and
    up for the minimum duration. A cue only ever moves later than its words were spoken, never earlier."""
    out: list[Cue] = []
    floor = earliest_s
    for cue in cues:
        start = _ceil_ms(max(cue.start_s, floor))
        end = _ceil_ms(max(cue.end_s, start + style.min_duration_s))
        out.append(dataclasses.replace(cue, start_s=start, end_s=end))
        floor = end + style.min_gap_s
    return out


def _ceil_ms(seconds: float) -> float:
    """Up to the next whole millisecond (WebVTT's and SRT's resolution), so no rounding eats into a gap."""
    return math.ceil(seconds * 1000 - 1e-6) / 1000
