"""Caption cues, written as WebVTT (with webvtt-py), SRT and JSON: the reply's phrases and words, the user's words,
and (caption mode) the LLM's cleaned caption of the user's words, aligned to the ASR's word times. Broadcast-style
cues (lines, reading speed, durations) are cut by `pipeline.caption_style.broadcast_cues`."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from difflib import SequenceMatcher
from itertools import accumulate, pairwise
from typing import Protocol

import srt
import webvtt
from num2words import num2words


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str
    lines: tuple[str, ...] = ()  # the text as shown, line by line (broadcast_cues); (): `text` on one line
    words: tuple[Cue, ...] = ()  # the words shown, each with the time it was spoken
    utterance: int = 0  # the utterance it shows, by its index in the input (a new cue at each change)

    @property
    def shown_lines(self) -> tuple[str, ...]:
        return self.lines or (self.text,)


def shown_cue(start_s: float, end_s: float, shown: str, utterance: int = 0) -> Cue:
    """The cue whose shown text is `shown`, its lines separated by line breaks, as the protos carry a broadcast
    cue (services/gateway/convert.caption_cue): its `text` is the lines joined by spaces."""
    lines = tuple(shown.split("\n"))
    return Cue(start_s, end_s, " ".join(lines), lines=lines, utterance=utterance)


def vtt_timestamp(seconds: float) -> str:
    ms = max(0, round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def caption_text(text: str) -> str:
    """One line of cue text: no line breaks, blank lines or timing arrow, which would end the cue or start
    another in WebVTT and SRT alike."""
    return " ".join(text.split()).replace("-->", "->")


def _document_lines(cue: Cue) -> list[str]:
    return [line for line in (caption_text(x) for x in cue.shown_lines) if line] or [""]


def to_webvtt_caption(cue: Cue) -> webvtt.Caption:
    """The cue as webvtt-py's Caption, a line of text per shown line; "&" and "<" escaped, as WebVTT's cue text
    requires (W3C WebVTT: they would start a character reference or a tag)."""
    text = "\n".join(_vtt_escaped(line) for line in _document_lines(cue))
    return webvtt.Caption(vtt_timestamp(cue.start_s), vtt_timestamp(cue.end_s), text)


def _vtt_escaped(line: str) -> str:
    return line.replace("&", "&amp;").replace("<", "&lt;")


def webvtt_document(cues: Iterable[Cue]) -> str:
    """A WebVTT document; no cues: the header alone, a valid empty document."""
    vtt = webvtt.WebVTT(captions=[to_webvtt_caption(c) for c in cues])
    return vtt.content


def srt_document(cues: Iterable[Cue]) -> str:
    """An SRT document, written by the `srt` package: numbered cues, a line of text per shown line; no cues: ""."""
    return srt.compose([srt.Subtitle(n, _ms(cue.start_s), _ms(cue.end_s), "\n".join(_document_lines(cue)))
                        for n, cue in enumerate(cues, start=1)])


def _ms(seconds: float) -> timedelta:
    return timedelta(milliseconds=max(0, round(seconds * 1000)))


def json_document(cues: Iterable[Cue]) -> str:
    """{"cues": [{"start", "end", "lines", "words": [{"text", "start", "end"}], "utterance"}]}, times in seconds to
    the ms; "utterance" (the cue's utterance, by its index in the input) lets a reader tell a cue break from an
    utterance change (`pipeline.caption_style.find_violations` does)."""
    return json.dumps({"cues": [
        {"start": round(c.start_s, 3), "end": round(c.end_s, 3), "lines": list(c.shown_lines),
         "words": [{"text": w.text, "start": round(w.start_s, 3), "end": round(w.end_s, 3)} for w in c.words],
         "utterance": c.utterance}
        for c in cues]}, ensure_ascii=False, indent=1) + "\n"


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
    return f"{caption.start} --> {caption.end}\n{caption.raw_text}\n"


class TimedWord(Protocol):
    """An ASR word, a gRPC Word or a Cue: read-only attributes are enough."""

    @property
    def text(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...


# Caption mode: the LLM's cleaned caption of a final transcript, each of its words timed from the ASR words it
# aligns to. Times are whole milliseconds inside (WebVTT's and SRT's resolution), so order and non-overlap are exact.

FILLERS = frozenset({"um", "umm", "uh", "uhh", "uhm", "er", "erm", "ah", "eh", "hm", "hmm", "mm", "mhm"})
INSERTED_MS_PER_CHAR = 60  # a caption word the ASR did not hear: its nominal length, per letter of its spoken form
INSERTED_MIN_MS, INSERTED_MAX_MS = 80, 400
MAX_TAKE_MS = 100  # the most a run of unheard words takes from each heard neighbour (the budget is 150 ms)
MIN_MATCHED = 1 / 3  # fewer of the caption's spoken tokens found in the transcript: the caption is spread instead

_PIECE = re.compile(
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?P<ord>st|nd|rd|th)?|(?P<word>[^\W\d_]+)|(?P<sym>[%&$€£])")
_LETTERS = re.compile(r"[^\W\d_]+")
_SYMBOLS = {"%": "percent", "&": "and", "$": "dollars", "€": "euros", "£": "pounds"}
_CURRENCIES = frozenset("$€£")  # said after the amount: "$5", "five dollars"


@dataclass
class _Block:
    """Caption words that share one stretch of time: a group aligned to ASR words, or a run of unheard words."""

    words: list[int]
    start_ms: int
    end_ms: int
    heard: bool


def align_caption(caption_text: str, words: Sequence[TimedWord]) -> list[Cue]:
    """One cue per caption word (whitespace-separated, as written), on the ASR words' timeline.

    Caption and transcript are compared as spoken tokens (lower case, letters only; numbers spelled out with
    num2words, the spelling that the other side uses: "25" and "twenty five", "2020" and "twenty twenty"), aligned
    with difflib's SequenceMatcher. A caption word takes the time of the ASR words it matches (several: their
    span; several caption words on one ASR word: shared in proportion to length); a caption word standing where
    the ASR heard other words (a corrected word) takes theirs, fillers excepted; dropped ASR words give their time
    to no one; a caption word with no ASR word gets a nominal length in the gap beside its neighbour, or shares
    (at most 100 ms) of its neighbours where the gap is too short; punctuation standing alone ("—") gets 1 ms at
    the edge of the word before it. A caption that hardly matches the transcript
    is spread over the utterance in proportion to length. Cues are ordered, non-overlapping, at least 1 ms
    long and inside [first word's start, last word's end] (widened at the end if it is shorter than 1 ms a word).
    """
    tokens = caption_text.split()
    if not tokens or not words:
        return []
    starts, ends = _timeline_ms(words)
    span = (starts[0], max(max(ends), starts[0] + len(tokens)))
    cap_keys, asr_keys = _spoken_keys(tokens, [w.text for w in words])
    links, matched = _links(cap_keys, asr_keys)
    if not links or matched < MIN_MATCHED * sum(len(k) for k in cap_keys):
        blocks = [_Block(list(range(len(tokens))), span[0], span[1], heard=True)]
    else:
        blocks = _blocks(links, cap_keys, asr_keys, starts, ends)
        _place_unheard(blocks, cap_keys, span)
    spans: list[tuple[int, int]] = []
    for block in blocks:
        spans += _split(block.start_ms, block.end_ms, [_spoken_len(cap_keys[j]) for j in block.words])
    return [Cue(s / 1000, e / 1000, tokens[j])
            for j, (s, e) in enumerate(_ordered(spans, *span))]


def _timeline_ms(words: Sequence[TimedWord]) -> tuple[list[int], list[int]]:
    """Word times in ms, starts never going back, no word ending before it starts."""
    starts: list[int] = []
    ends: list[int] = []
    for w in words:
        start = round(w.start_s * 1000)
        start = max(start, starts[-1]) if starts else start
        starts.append(start)
        ends.append(max(round(w.end_s * 1000), start))
    return starts, ends


def _spoken_keys(tokens: list[str], heard: list[str]) -> tuple[list[list[str]], list[list[str]]]:
    """Each caption token's and ASR word's spoken tokens; a number takes the spelling the other side agrees with."""
    caption_default = Counter(k for t in tokens for k in _keys(t, None))
    asr_keys = [_keys(t, caption_default) for t in heard]
    asr_counter = Counter(k for ks in asr_keys for k in ks)
    return [_keys(t, asr_counter) for t in tokens], asr_keys


def _keys(token: str, other: Counter[str] | None) -> list[str]:
    out: list[str] = []
    currency: list[str] = []
    for m in _PIECE.finditer(token.lower().replace("'", "").replace("\u2019", "")):
        if m["word"]:
            out.append(m["word"])
        elif m["sym"]:
            said = [[], [_SYMBOLS[m["sym"]]]]
            if m["sym"] in _CURRENCIES:
                currency = _best(said, other)
            else:
                out += _best(said, other)
        else:
            out += _best(_number_spellings(m["num"], bool(m["ord"])), other) + currency
            currency = []
    return out + currency


def _number_spellings(digits: str, ordinal: bool) -> list[list[str]]:
    """Ways to say a number as spoken tokens, the usual one first."""
    try:
        value = Decimal(digits.replace(",", ""))
        if ordinal:
            return [_LETTERS.findall(num2words(int(value), to="ordinal"))]
        spellings = [_LETTERS.findall(num2words(value))]
        if "," not in digits and "." not in digits:
            if len(digits) == 4:
                spellings.append(_LETTERS.findall(num2words(int(value), to="year")))
            if len(digits) > 1:
                spellings.append([_LETTERS.findall(num2words(int(d)))[0] for d in digits])
        return spellings
    except (ArithmeticError, InvalidOperation, OverflowError, ValueError, NotImplementedError):
        return [[digits]]


def _best(spellings: list[list[str]], other: Counter[str] | None) -> list[str]:
    """The spelling most of whose tokens the other side has (the first on a tie, or with nothing to compare)."""
    if other is None:
        return spellings[0]

    def score(keys: list[str]) -> int:
        return 2 * sum(min(n, other[k]) for k, n in Counter(keys).items()) - len(keys)

    return max(spellings, key=score)


def _spoken_len(keys: list[str]) -> int:
    return sum(len(k) for k in keys)


def _links(cap_keys: list[list[str]], asr_keys: list[list[str]]) -> tuple[set[tuple[int, int]], int]:
    """(caption word, ASR word) pairs that align, and how many caption tokens matched exactly."""
    cap = [(k, j) for j, ks in enumerate(cap_keys) for k in ks]
    asr = [(k, i) for i, ks in enumerate(asr_keys) for k in ks]
    matcher = SequenceMatcher(None, [k for k, _ in asr], [k for k, _ in cap], autojunk=False)
    links: set[tuple[int, int]] = set()
    matched = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            links.update((cap[j1 + d][1], asr[i1 + d][1]) for d in range(i2 - i1))
            matched += i2 - i1
        elif tag == "replace":  # corrected words: one for one where the counts agree, else all on the span
            said = list(dict.fromkeys(j for _, j in cap[j1:j2]))
            heard = [i for i in dict.fromkeys(i for _, i in asr[i1:i2]) if not set(asr_keys[i]) <= FILLERS]
            if len(said) == len(heard):
                links.update(zip(said, heard, strict=True))
            else:
                links.update((j, i) for j in said for i in heard)
    return links, matched


def _blocks(links: set[tuple[int, int]], cap_keys: list[list[str]], asr_keys: list[list[str]],
            starts: list[int], ends: list[int]) -> list[_Block]:
    """Caption words in order, as blocks: linked words grouped where they share ASR words, unheard runs between."""
    groups: list[list[int]] = []  # [first caption word, last, first ASR word, last]
    for j, i in sorted(links):
        if groups and (j <= groups[-1][1] or i <= groups[-1][3]):
            g = groups[-1]
            g[1], g[2], g[3] = max(g[1], j), min(g[2], i), max(g[3], i)
            while len(groups) > 1 and groups[-2][3] >= groups[-1][2]:  # a crossing link joins the groups it spans
                before = groups.pop(-2)
                g[0], g[2], g[3] = before[0], min(before[2], g[2]), max(before[3], g[3])
        else:
            groups.append([j, j, i, i])
    group_of: dict[int, int] = {j: n for n, g in enumerate(groups) for j in range(g[0], g[1] + 1)}
    blocks: list[_Block] = []
    current: int | None = None
    for j in range(len(cap_keys)):
        n = group_of.get(j)
        if n is not None:
            if current != n:
                g = groups[n]
                blocks.append(_Block([], starts[g[2]], ends[g[3]], heard=True))
                current = n
            blocks[-1].words.append(j)
        elif blocks and (not cap_keys[j] or not blocks[-1].heard):  # punctuation rides with the word before
            blocks[-1].words.append(j)
        else:
            blocks.append(_Block([j], 0, 0, heard=False))
            current = None
    if len(blocks) > 1 and not any(cap_keys[j] for j in blocks[0].words):  # leading punctuation: the first word's
        leading = blocks.pop(0)
        blocks[0].words[:0] = leading.words
    return blocks


def _place_unheard(blocks: list[_Block], cap_keys: list[list[str]], span: tuple[int, int]) -> None:
    """Time for each run of caption words the ASR did not hear: a nominal length in the gap beside the word before
    (or after, at the start), or where the gap is shorter, what it lacks taken from the neighbours' edges."""
    for n, block in enumerate(blocks):
        if block.heard:
            continue
        before = blocks[n - 1] if n > 0 else None
        after = blocks[n + 1] if n + 1 < len(blocks) else None
        gap_start = before.end_ms if before else span[0]
        gap_end = max(after.start_ms if after else span[1], gap_start)
        want = sum(min(INSERTED_MAX_MS, max(INSERTED_MIN_MS, INSERTED_MS_PER_CHAR * _spoken_len(cap_keys[j])))
                   for j in block.words if cap_keys[j])
        if gap_end - gap_start >= want:
            block.start_ms, block.end_ms = (gap_start, gap_start + want) if before else (gap_end - want, gap_end)
            continue
        short = want - (gap_end - gap_start)
        take_before, take_after = _spare(before), _spare(after)
        take_before = min(take_before, short // 2)
        take_after = min(take_after, short - take_before)
        take_before = min(_spare(before), short - take_after)
        block.start_ms, block.end_ms = gap_start - take_before, gap_end + take_after
        if before:
            before.end_ms -= take_before
        if after:
            after.start_ms += take_after


def _spare(block: _Block | None) -> int:
    return min(MAX_TAKE_MS, (block.end_ms - block.start_ms) // 2) if block else 0


def _split(start: int, end: int, weights: list[int]) -> list[tuple[int, int]]:
    """[start, end] cut in pieces in proportion to the weights (all alike if all are 0)."""
    weights = weights if any(weights) else [1] * len(weights)
    total = sum(weights)
    return list(pairwise([start, *(start + (end - start) * acc // total for acc in accumulate(weights))]))


def _ordered(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The least change that makes spans ordered, non-overlapping, each at least 1 ms, inside [lo, hi]
    (hi - lo >= len(spans)): starts pushed past the previous end, then ends pulled back from the next start."""
    out: list[list[int]] = []
    end = lo
    for s, e in spans:
        s = max(s, end)
        end = max(e, s + 1)
        out.append([s, end])
    start = hi
    for cue in reversed(out):
        cue[1] = min(cue[1], start)
        cue[0] = min(cue[0], cue[1] - 1)
        start = cue[0]
    return [(s, e) for s, e in out]
