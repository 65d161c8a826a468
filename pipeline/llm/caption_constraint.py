"""Captions that say only what was said: the allowed edits of a transcript, as an automaton over bytes and as
a mask on a model's logits at every decoding step.

A caption of a transcript may change casing and punctuation, break sentences, drop fillers ("um", "you
know") and immediate repetitions ("I I think"), and write numbers, times and amounts as digits where the words
say them ("twenty five dollars" -> "$25", and back). Nothing else: no word inserted, substituted or reordered.

- `TranscriptLattice`: the transcript as its tokens and, between token boundaries, the written forms each
  span may take (its words as said, a number's digits, an empty form for a filler or a repeated word).
- `CaptionAutomaton`: a nondeterministic automaton over the caption's UTF-8 bytes that accepts exactly the
  faithful captions: words of the lattice's forms in one of four casings, between words punctuation in
  prose's order (at most `MAX_MARKS` marks), the end only when every word was written.
- `TokenConstraint`: the automaton lifted to a tokenizer's tokens (a walk of a byte trie of the vocabulary),
  so a decoding step masks every token that leaves it. Applied to the target's logits alike in plain decoding
  and in speculative verification, the committed tokens are the constrained target's, whatever drafted them.
- `unsaid_words`: the independent check (no automaton) of a finished caption against its transcript.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import lru_cache

import torch
from num2words import num2words
from text_to_num import text2num

from pipeline.llm.drafters import EMPTY, Draft

DEFAULT_FILLERS = ("um", "umm", "uh", "uhh", "uhm", "er", "erm", "ah", "hmm", "mm", "you know")
MAX_MARKS = 3  # punctuation marks between two words, dashes counted ('?" (', ' — '); spaces apart
MAX_NUMBER_WORDS = 8  # the longest run of number words read as one number
# what may stand between words: punctuation, and one space at a time (no line breaks: cues break lines themselves)
SEPARATORS = frozenset(" .,;:!?-\"'()\u2014\u2013\u2026\u201c\u201d\u2018\u2019")
APOSTROPHES = frozenset("'\u2019")
CURRENCY_SIGNS = {"$": "dollars", "£": "pounds", "€": "euros"}
CURRENCY_WORDS = {"dollar": "$", "dollars": "$", "pound": "£", "pounds": "£", "euro": "€", "euros": "€"}
_WORD = re.compile(r"[^\W_]+(?:['\u2019][^\W_]+)*")
# a transcript's tokens: a number with its symbols ("$25", "3:30", "1,000", "21st", "25%"), or a word
_TOKEN = re.compile(r"[$£€]?\d+(?:[,.:]\d+)*(?:st|nd|rd|th)?%?|[^\W_]+(?:['\u2019][^\W_]+)*")
_LETTERS = re.compile(r"[^\W\d_]+")
_NUMBER_WORDS = frozenset(
    "zero oh one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million "
    "billion and point".split())
_ORDINALS = {"first": "one", "second": "two", "third": "three", "fifth": "five", "eighth": "eight", "ninth": "nine",
             "twelfth": "twelve"}  # the rest drop "th" ("fourth"), or "ieth" for "y" ("twentieth")


def _cardinal_of_ordinal(word: str) -> str | None:
    if word in _ORDINALS:
        return _ORDINALS[word]
    if word.endswith("ieth") and word[:-4] + "y" in _NUMBER_WORDS:
        return word[:-4] + "y"
    if word.endswith("th") and word[:-2] in _NUMBER_WORDS:
        return word[:-2]
    return None


def word_key(word: str) -> str:
    """How a written word is compared: lower case, apostrophes dropped ("Don't" and "dont" are one word)."""
    return word.lower().replace("'", "").replace("\u2019", "")


def transcript_tokens(text: str) -> list[str]:
    """A transcript's words and numbers, a number with its symbols: "It's $25 at 3:30." -> It's, $25, at, 3:30."""
    return _TOKEN.findall(text)


def _between_tokens(transcript: str) -> list[str]:
    """What the transcript writes before each of its tokens (`transcript_tokens`) but the first, in order."""
    spans = [m.span() for m in _TOKEN.finditer(transcript)]
    return [transcript[before[1] : after[0]] for before, after in itertools.pairwise(spans)]


def marked(transcript: str) -> frozenset[int]:
    """The indexes of the transcript's tokens (`transcript_tokens`) it puts a clause or sentence mark before."""
    return frozenset(i for i, text in enumerate(_between_tokens(transcript), 1) if (CLAUSE | SENTENCE) & set(text))


def hyphen_joined(transcript: str) -> frozenset[int]:
    """The indexes of the transcript's tokens (`transcript_tokens`) it joins to the token before by a hyphen
    ("cold-hearted": the second)."""
    return frozenset(i for i, text in enumerate(_between_tokens(transcript), 1) if text == "-")


def written_words(text: str) -> list[str]:
    """A text's words as a caption writes them: letters and digits, apostrophes inside ("don't", "25")."""
    return _WORD.findall(text)


# -- the transcript's spoken form and the numbers in it ------------------------------------------------------

def number_spellings(digits: str) -> list[list[str]]:
    """How a written number may have been said, as word keys: "25" -> twenty five; "2020" -> two thousand
    and twenty, twenty twenty; "21st" -> twenty first; "3.5" -> three point five; "3:30" -> three thirty."""
    out: list[list[str]] = []
    if digits[:1] in CURRENCY_SIGNS:
        return [s + [CURRENCY_SIGNS[digits[0]]] for s in number_spellings(digits[1:])]
    if digits.endswith("%"):
        return [s + ["percent"] for s in number_spellings(digits[:-1])]
    if m := re.fullmatch(r"(\d{1,2}):(\d{2})", digits):
        hour, minute = int(m[1]), int(m[2])
        said = _said(hour)
        if minute == 0:
            return [said + ["oclock"], said]
        return [said + (["oh"] + _said(minute) if minute < 10 else _said(minute))]
    if m := re.fullmatch(r"(\d+)(st|nd|rd|th)", digits, re.IGNORECASE):
        return [_LETTERS.findall(num2words(int(m[1]), to="ordinal").lower())]
    plain = digits.replace(",", "")
    try:
        value = Decimal(plain)
    except InvalidOperation:
        return [[digits.lower()]]
    if not value.is_finite() or value >= 10**15:
        return [[digits.lower()]]
    spelled = _LETTERS.findall(num2words(value).lower())
    out.append(spelled)
    if "and" in spelled:
        out.append([w for w in spelled if w != "and"])
    if plain.isdigit() and len(plain) == 4 and "," not in digits:
        out.append(_LETTERS.findall(num2words(int(plain), to="year").lower()))
    return out


def _said(value: int) -> list[str]:
    return _LETTERS.findall(num2words(value).lower())


@dataclass(frozen=True)
class Form:
    """One way a lattice span may be written: its words (keys), or a literal (digits, symbols) written as is."""

    start: int  # the span of transcript units it stands for
    end: int
    words: tuple[str, ...] = ()  # the words as cased here, apostrophes free inside them
    literal: str = ""  # written exactly ("$25", "3:30", "21st"), a word of its own
    at_start: bool | None = None  # written so only at a sentence's start (True), only inside one (False)

    @property
    def dropped(self) -> bool:
        """Written as nothing: a filler, a word said again at once."""
        return not self.words and not self.literal


@dataclass
class TranscriptLattice:
    """The transcript's spoken units (word keys, in order) and the forms a caption may write them in."""

    units: list[str]
    forms: list[list[Form]] = field(default_factory=list)  # forms[i]: the forms that start at unit i

    @classmethod
    def of(cls, transcript: str, fillers: Iterable[str] = DEFAULT_FILLERS) -> TranscriptLattice:
        tokens = transcript_tokens(transcript)
        units = [word_key(t) for t in tokens]  # a number stays one unit, written as digits or in words
        lattice = cls(units, [[] for _ in range(len(units) + 1)])
        starts = {0} | {i for i, text in enumerate(_between_tokens(transcript), 1) if SENTENCE & set(text)}
        for i, token in enumerate(tokens):
            if token[0].isdigit() or token[0] in CURRENCY_SIGNS:
                lattice.forms[i] += [Form(i, i + 1, literal=token),
                                     *(form for said in _number_sayings(token)
                                       for form in _cased(i, i + 1, tuple(said), False))]
                if token[0].isdigit() and not token.endswith("%"):  # "25,000 dollars" -> "$25,000"
                    lattice.forms[i] += [Form(i, stop, literal=text) for text, stop in _with_units(token, units, i + 1)
                                         if stop > i + 1]
            else:  # the word as the transcript spells it: its apostrophes may stay or go, but come nowhere else
                spelled = token.replace("\u2019", "'")
                lattice.forms[i] += _cased(i, i + 1, (spelled,), i in starts)
        lattice._add_numbers()
        lattice._add_drops([f.split() for f in fillers])
        return lattice

    def _add_numbers(self) -> None:
        """Digits for every run of number words they spell (checked by spelling the digits back); a number of
        one or two digits in the run stands for its words ("3 30", as whisper writes "three thirty": "3:30")."""
        units, seen = self.units, {(f.start, f.end, f.literal) for fs in self.forms for f in fs}
        spoken_as = [[u] if u in _NUMBER_WORDS or _cardinal_of_ordinal(u) is not None
                     else _said(int(u)) if re.fullmatch(r"\d{1,2}", u) else None for u in units]
        for start in range(len(units)):
            words: list[str] = []
            for end in range(start + 1, min(len(units), start + MAX_NUMBER_WORDS) + 1):
                spoken = spoken_as[end - 1]
                if spoken is None:
                    break
                words += spoken
                if end - start == 1 and units[start][0].isdigit():
                    continue  # written as digits already
                for literal in _digits_for(words):
                    for text, stop in _with_units(literal, units, end):
                        if (start, stop, text) not in seen:
                            seen.add((start, stop, text))
                            self.forms[start].append(Form(start, stop, literal=text))

    @property
    def said(self) -> list[list[str]]:
        """Each unit as said, in word keys (a number: its first spelling)."""
        return [next((list(f.words) for f in fs if f.words and f.end == i + 1), [u])
                for i, (u, fs) in enumerate(zip(self.units, self.forms, strict=False))]

    def _add_drops(self, fillers: list[list[str]]) -> None:
        """Empty forms: a filler (a word or a phrase of the list), a word said again at once."""
        units = self.units
        for i in range(len(units)):
            for filler in fillers:
                if filler and units[i : i + len(filler)] == filler:
                    self.forms[i].append(Form(i, i + len(filler)))
            if i + 1 < len(units) and units[i] == units[i + 1]:
                self.forms[i].append(Form(i, i + 1))


# Words written with a capital wherever they stand.
ALWAYS_CAPITAL = frozenset({"i", "i'm", "i've", "i'll", "i'd"})


def _cased(start: int, end: int, words: tuple[str, ...], sentence_start: bool) -> list[Form]:
    """The forms of words as a caption cases them: a capital first letter at a sentence's start, and inside
    one the transcript's capitals where they are its own (names, acronyms, "I"), not those of a sentence it
    began there ("Chicago. Oh I'm" may become "Chicago, oh, I'm"), else lower case. Not letter by letter
    ("aboVe" is no word's casing), and no capitals elsewhere: a small model wrote title case mid-sentence
    ("Really good performances. Against Top, Teams That, Have Ended") and shouted whole captions
    ("DIFFERENT WORDS: That, I, did, not, say")."""
    first = words[0]
    own = (any(c.isupper() for w in words for c in w[1:]) or any(w[:1].isupper() for w in words[1:])
           or first.lower() in ALWAYS_CAPITAL or first[:1].isupper() and not sentence_start)
    inside = words if own else tuple(w.lower() for w in words)
    at_start = (inside[0][:1].upper() + inside[0][1:], *inside[1:])
    if at_start == inside:
        return [Form(start, end, inside)]
    return [Form(start, end, inside, at_start=False), Form(start, end, at_start, at_start=True)]


def _number_sayings(token: str) -> list[list[str]]:
    """A written number's spoken forms, and its digits with the unit in words ("$25" -> 25 dollars)."""
    out = number_spellings(token)
    if token[0] in CURRENCY_SIGNS:
        out.append([token[1:], CURRENCY_SIGNS[token[0]]])
    if token.endswith("%"):
        out.append([token[:-1], "percent"])
    return out


def _digits_for(words: list[str]) -> list[str]:
    """The digit forms that say exactly these number words: a cardinal, a decimal, a year, a time, an ordinal."""
    out: list[str] = []
    text = " ".join(words)
    if (cardinal := _cardinal_of_ordinal(words[-1])) is not None:  # "twenty first" -> 21st
        value = _cardinal([*words[:-1], cardinal])
        if value is not None:
            suffix = "th" if 10 <= value % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(value % 10, "th")
            out.append(f"{value}{suffix}")
    elif "point" in words:
        i = words.index("point")
        whole = _cardinal(words[:i])
        decimals = [_cardinal([w]) for w in words[i + 1 :]]
        if whole is not None and decimals and all(d is not None and d < 10 for d in decimals):
            out.append(f"{whole}.{''.join(str(d) for d in decimals)}")
    elif (value := _cardinal(words)) is not None:
        out.append(str(value))
        if value >= 10_000:
            out.append(f"{value:,}")
    if len(words) >= 2 and "and" not in words:  # "nineteen eighty four", "three thirty", "ten oh five"
        for cut in range(1, len(words)):
            high, low = _cardinal(words[:cut]), _cardinal(words[cut:] if words[cut] != "oh" else words[cut + 1 :])
            if high is None or low is None:
                continue
            if words[cut] == "oh" and low < 10:
                out += [f"{high}:{low:02d}"] if 1 <= high <= 12 else []
                continue
            if 10 <= high <= 99 and 10 <= low <= 99:
                out.append(f"{high}{low:02d}")  # a year
            if 1 <= high <= 12 and 10 <= low <= 59:
                out.append(f"{high}:{low:02d}")  # a time
    return [d for d in dict.fromkeys(out) if any(s == words for s in number_spellings(d)) or _says(d, text)]


def _says(digits: str, text: str) -> bool:
    return any(" ".join(s) == text for s in number_spellings(digits))


def _cardinal(words: list[str]) -> int | None:
    if not words or words[0] == "and" or words[-1] == "and" or "point" in words or "oh" in words:
        return None
    try:
        value = text2num(" ".join(words), "en")
    except ValueError:
        return None
    return value if any(s == words for s in number_spellings(str(value))) else None


def _with_units(literal: str, units: list[str], end: int) -> list[tuple[str, int]]:
    """A number's digits alone, and with the unit said after it: "$25" for twenty five dollars, "25%"."""
    out = [(literal, end)]
    after = units[end] if end < len(units) else ""
    if after in CURRENCY_WORDS and ":" not in literal:
        out.append((CURRENCY_WORDS[after] + literal, end + 1))
    if after == "percent":
        out.append((literal + "%", end + 1))
    if after == "oclock" and ":" not in literal:
        out.append((literal + ":00", end + 1))
    return out


# -- the automaton over bytes ---------------------------------------------------------------------------------

# Between two words a caption may write punctuation as prose does: after the word, a clause mark (",;:") or a
# sentence's end (".", "?!", "..."), a closing quote or bracket, then one space; after the space an opening quote
# or bracket, or a dash standing between spaces (" — "); a hyphen may join two words the transcript joins
# ("well-known": not "To-be-rather-cold-hearted", which a small model wrote and no line can break).
CLAUSE = frozenset(",;:")
SENTENCE = frozenset(".!?\u2026")
CLOSERS = frozenset("\"')\u201d\u2019")
OPENERS = frozenset("\"'(\u201c\u2018")
DASHES = frozenset("-\u2013\u2014")
SEPARATORS = CLAUSE | SENTENCE | CLOSERS | OPENERS | DASHES | {" "}
# where a gap stands: the caption's start, just after a word, after a sentence mark, after a closing quote, after
# the space, after an opening quote, after a spaced dash, after the space that follows it, after a joining hyphen,
# after a clause mark (which no other mark follows but a closing quote: not ",!" or ",,")
START, CLOSE, PUNCT, QUOTE, SPACE, OPEN, DASH, AFTER_DASH, JOIN, CLAUSED = range(10)
# A clause of fewer than MIN_OWN_CLAUSE_WORDS words that a mark of the caption's own began (",;:" or ".?!…") may
# not end in another such mark but at the caption's end: the model otherwise put a comma after every word ("But,
# as, the, writer, should, by, time, …"), a verify pass each, 34 passes and 1.6 s for a 15-word caption live;
# barred from that, a period after every other word ("Unless, to be. Rather cold-hearted, and rather selfish. Is
# to be.", "Really good performances. Against top. Teams that"). A mark the transcript has there is always
# allowed (whisper writes the commas of a spoken aside itself: "It was, in fact, great.").
MIN_OWN_CLAUSE_WORDS = 3
ENDS = (CLOSE, PUNCT, QUOTE, CLAUSED)  # where the caption may end, once every word is written

# A state is one of:
#   ("gap", unit, phase, marks written, run, opened, sentence): between words, `unit` the next one to write;
#     `run`: the words so far of a clause a mark of the caption's own began (MIN_OWN_CLAUSE_WORDS: enough, or
#     another clause); `opened`: this gap wrote such a mark; `sentence`: the next word begins a sentence (the
#     caption's start, or this gap wrote a sentence mark);
#   ("word", unit, form, word, characters written, run): inside word `word` of one of unit's forms, `run` the
#     words of its clause before it;
#   ("inner", unit, form, word, run): between two words of one form ("twenty five", "twenty-five");
#   ("literal", unit, form, bytes written, run): inside a number written as digits ("$25");
#   ("bytes", the rest of a character's bytes, the state once they are read): inside a character.
State = tuple
# TokenConstraint's mark on the states after a token that ends in a space: the next token may not begin a word
AFTER_SPACE: State = ("after space",)


class CaptionAutomaton:
    """The faithful captions of one transcript, read a byte at a time (an NFA: a set of states).

    Quotes, brackets and dashes come only where the transcript has some: a small model otherwise wraps word
    after word in them ('“CAN”, “You”, “TELL”') until its token limit, which a caption's few marks never reach.
    """

    def __init__(self, lattice: TranscriptLattice, transcript: str = "") -> None:
        self.lattice = lattice
        self.end = len(lattice.units)
        written = set(_TOKEN.sub(" ", transcript))  # marks outside words: "beauty's" has an apostrophe, no quote
        self.closers = CLOSERS & written
        self.openers = OPENERS & written
        self.dashes = (DASHES - {"-"}) & written | ({"-"} if " - " in transcript else set())
        self.joined = hyphen_joined(transcript)  # units the transcript joins to the one before by a hyphen
        self.marked = marked(transcript)  # units the transcript puts a clause or sentence mark before
        # Where the speech goes on past the transcript, or went on into it (cut at the cap, or after a short
        # pause), whisper, which heard on, writes no sentence mark at its end, or a lower-case first word
        # ("… I thought you" | "know, I heard of these"): the caption begins a sentence where the transcript
        # does, and ends in a sentence or clause mark only where the transcript ends in one (not "… different
        # than." | "The acoustic corpus", nor "… write a poem out in the sea," of a sentence that ended).
        spans = list(_TOKEN.finditer(transcript))
        tail = set(transcript[spans[-1].end() :]) if spans else set()
        self.end_marks = (SENTENCE if SENTENCE & tail else frozenset()) | (CLAUSE if CLAUSE & tail else frozenset())
        self.begins_sentence = not (spans and spans[0].group()[0].islower())
        # units inside a number the caption may write as one ("3:30" for "three thirty"): no mark of the
        # caption's own before them ("at 3: 30", where the model began the time and wrote the colon as a mark)
        self.in_numbers = frozenset(u for forms in lattice.forms for f in forms if f.literal and f.end - f.start > 1
                                    for u in range(f.start + 1, f.end))
        self._next: dict[frozenset[State], dict[int, frozenset[State]]] = {}

    def start(self) -> frozenset[State]:
        return self._closure([("gap", 0, START, 0, MIN_OWN_CLAUSE_WORDS, False, self.begins_sentence)])

    def accepts(self, states: frozenset[State]) -> bool:
        """The caption may end here: every unit written (or dropped), after a word or its closing marks."""
        return any(s[0] == "gap" and s[1] == self.end and (s[2] in ENDS or self.end == 0) for s in states)

    def read(self, states: frozenset[State], data: bytes) -> frozenset[State]:
        for byte in data:
            if not states:
                break
            states = self.next_bytes(states).get(byte, frozenset())
        return states

    def next_bytes(self, states: frozenset[State]) -> dict[int, frozenset[State]]:
        """Every byte some state allows, and the states it leads to."""
        known = self._next.get(states)
        if known is not None:
            return known
        moves: dict[int, list[State]] = {}
        for state in states:
            if state[0] == "bytes":
                moves.setdefault(state[1][0], []).append(("bytes", state[1][1:], state[2]))
                continue
            for char, target in self._moves(state):
                data = char.encode()
                moves.setdefault(data[0], []).append(target if len(data) == 1 else ("bytes", data[1:], target))
        out = self._next[states] = {byte: self._closure(targets) for byte, targets in moves.items()}
        return out

    def _moves(self, state: State) -> list[tuple[str, State]]:
        """A state's moves, a character at a time (`next_bytes` splits a character into its bytes)."""
        kind = state[0]
        if kind == "gap":
            return self._gap_moves(*state[1:])
        if kind == "inner":
            _, unit, f, w, run = state
            return [(c, ("word", unit, f, w, 0, run)) for c in " -"]
        if kind == "literal":
            _, unit, f, got, run = state
            literal = self.lattice.forms[unit][f].literal
            return [(literal[got], ("literal", unit, f, got + 1, run))] if got < len(literal) else []
        _, unit, f, w, c, run = state
        word = self.lattice.forms[unit][f].words[w]
        if c >= len(word):
            return []
        chars = "'\u2019" if word[c] == "'" else word[c]
        return [(ch, ("word", unit, f, w, c + 1, run)) for ch in chars]

    def _gap_moves(self, unit: int, phase: int, marks: int, run: int, opened: bool,
                   sentence: bool) -> list[tuple[str, State]]:
        """Punctuation in prose's order (see SEPARATORS) and a word's first character, cased as it stands (at a
        sentence's start, inside one, or either after an opening quote); past the last word, closing marks only.
        No state is a dead end: from each, some caption goes on to its end."""
        moves: list[tuple[str, State]] = []
        room = marks < MAX_MARKS

        def gap(next_phase: int, added: int = 1, opens: bool = opened, ends: bool = sentence) -> State:
            return ("gap", unit, next_phase, marks + added, run, opens, ends)

        own = unit not in self.marked
        barred = run < MIN_OWN_CLAUSE_WORDS and unit < self.end or unit in self.in_numbers
        if room and phase in (CLOSE, PUNCT, QUOTE) and not (barred and own):
            closing = unit == self.end
            if not closing or SENTENCE & self.end_marks:
                moves += [(c, gap(PUNCT, opens=opened or own, ends=True)) for c in SENTENCE]  # "?!", "..."
            if phase != PUNCT and (not closing or CLAUSE & self.end_marks):
                moves += [(c, gap(CLAUSED, opens=own)) for c in CLAUSE]
        if room and phase in (CLOSE, PUNCT, CLAUSED):
            moves += [(c, gap(QUOTE)) for c in self.closers]
        if unit == self.end:
            return moves
        if phase in (CLOSE, PUNCT, QUOTE, CLAUSED):
            moves.append((" ", gap(SPACE, 0)))
        if phase == CLOSE and unit in self.joined:
            moves.append(("-", gap(JOIN)))
        if phase == DASH:
            moves.append((" ", gap(AFTER_DASH, 0)))
        if room and phase in (START, SPACE, AFTER_DASH):
            moves += [(c, gap(OPEN, opens=False)) for c in self.openers]  # a quote begins a clause of its own
        if room and phase == SPACE:
            moves += [(c, gap(DASH)) for c in self.dashes]
        if phase in (START, SPACE, OPEN, AFTER_DASH, JOIN):  # a word starts
            # its clause: one of the caption's own marks began, one of the transcript's marks began, or goes on
            clause = 0 if opened else MIN_OWN_CLAUSE_WORDS if marks else run
            for f, form in enumerate(self.lattice.forms[unit]):
                if form.at_start is not None and form.at_start != sentence and phase != OPEN:
                    continue
                if form.literal:
                    moves.append((form.literal[0], ("literal", unit, f, 1, clause)))
                elif form.words:
                    moves += self._moves(("word", unit, f, 0, 0, clause))
        return moves

    def _closure(self, states: Iterable[State]) -> frozenset[State]:
        """States as they settle: a character's bytes read, a word, literal or form written, an apostrophe left
        out, a dropped form (a filler, a repeated word) skipped."""
        out: set[State] = set()
        todo = list(states)
        while todo:
            state = todo.pop()
            if state in out:
                continue
            kind = state[0]
            if kind == "bytes" and not state[1]:
                todo.append(state[2])
                continue
            if kind == "word":
                _, unit, f, w, c, run = state
                form = self.lattice.forms[unit][f]
                word = form.words[w]
                if c < len(word) and word[c] == "'":
                    todo.append(("word", unit, f, w, c + 1, run))
                if c == len(word):
                    todo.append(("inner", unit, f, w + 1, run) if w + 1 < len(form.words) else _gap_after(form, run))
                    continue
            elif kind == "literal":
                _, unit, f, got, run = state
                form = self.lattice.forms[unit][f]
                if got == len(form.literal):
                    todo.append(_gap_after(form, run))
                    continue
            elif kind == "gap" and state[1] < self.end:
                todo += [("gap", form.end, *state[2:]) for form in self.lattice.forms[state[1]] if form.dropped]
            out.add(state)
        return frozenset(out)


def _gap_after(form: Form, run: int) -> State:
    """The gap just after a form is written, its clause one word longer than `run`."""
    return ("gap", form.end, CLOSE, 0, min(run + 1, MIN_OWN_CLAUSE_WORDS), False, False)


# -- the automaton over a tokenizer's tokens ------------------------------------------------------------------

class VocabularyTrie:
    """A tokenizer's tokens as a trie of their bytes, so the tokens an automaton allows are found by walking
    only the bytes it allows (a few hundred nodes a step), not by testing 49,152 tokens."""

    def __init__(self, token_bytes: dict[int, bytes]) -> None:
        self.root: dict = {}
        self.token_bytes = token_bytes
        for token, data in token_bytes.items():
            if not data:
                continue
            node = self.root
            for byte in data:
                node = node.setdefault(byte, {})
            node.setdefault(None, []).append(token)

    @classmethod
    def of(cls, tokenizer: object) -> VocabularyTrie:
        """One trie per tokenizer, built once (about a second for a 49k vocabulary)."""
        trie = _TRIES.get(tokenizer)
        if trie is None:
            trie = _TRIES[tokenizer] = cls(token_bytes(tokenizer))
        return trie


_TRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: object) -> dict[int, bytes]:
    """Each ordinary token's bytes: byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen) or SentencePiece (a "▁" for
    a space, "<0x0A>" byte tokens). Special tokens get none: a caption never contains them."""
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    special = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = _byte_decoder()
    byte_level = sum(all(ch in decoder for ch in piece) for piece in vocab) > 0.9 * len(vocab)
    out: dict[int, bytes] = {}
    for piece, token in vocab.items():
        if token in special:
            continue
        if byte_level:
            if all(ch in decoder for ch in piece):
                out[token] = bytes(decoder[ch] for ch in piece)
        elif m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            out[token] = bytes([int(m[1], 16)])
        elif not (piece.startswith("<") and piece.endswith(">")):
            out[token] = piece.replace("\u2581", " ").encode()
    return out


class TokenConstraint:
    """The caption automaton of one transcript over a tokenizer's tokens: at each step, the tokens that keep the
    caption faithful (and the end-of-sequence tokens once it may end), as a mask on the target's logits.

    The tokens write the caption as the tokenizer itself would (`_as_tokenized`): a word's letters in its own
    tokens, a space with the word after it. The automaton's bytes alone would let the model spell a word it did
    not expect letter by letter ("I", "g", "nor", "e," for "Ignore", 33 tokens for a 15-token caption), text no
    tokenizer writes, which the small target continues badly ("And," "From." where the transcript has neither:
    9 of 69 captions of `specvox bench captions`' live clips) and which the transcript's drafts, written as
    the tokenizer writes them, miss."""

    def __init__(self, transcript: str, tokenizer: object, eos_token_ids: Iterable[int],
                 fillers: Iterable[str] = DEFAULT_FILLERS) -> None:
        self.lattice = TranscriptLattice.of(transcript, fillers)
        self.automaton = CaptionAutomaton(self.lattice, transcript)
        self.trie = VocabularyTrie.of(tokenizer)
        self.tokenizer = tokenizer
        self.eos = tuple(sorted(eos_token_ids))
        self._allowed: dict[frozenset[State], dict[int, frozenset[State]]] = {}
        self._splits: dict[str, list[tuple[int, int, dict[str, frozenset[int]]]]] = {}
        self._space_joins_word = self._tokens_of(" the") == [b" the"]  # byte-level BPE; not SentencePiece's

    def start(self) -> frozenset[State]:
        return self.automaton.start()

    def allowed(self, states: frozenset[State]) -> dict[int, frozenset[State]]:
        """The tokens allowed after `states`, each with the states it leads to (an end token: to no state)."""
        if states not in self._allowed:
            found: dict[int, frozenset[State]] = {}
            self._walk(self.trie.root, states - {AFTER_SPACE}, found)
            spaced, out = AFTER_SPACE in states, {}
            for token, after in found.items():
                if kept := self._as_tokenized(token, after, spaced):
                    out[token] = kept
            if not out:  # no token writes the next text as the tokenizer would (a form none of its tokens fits)
                out = found
            if self.automaton.accepts(states) or not out:  # (not out: no state here has a way on; never so)
                out.update((token, frozenset()) for token in self.eos)
            self._allowed[states] = out
        return self._allowed[states]

    def _as_tokenized(self, token: int, after: frozenset[State], spaced: bool) -> frozenset[State]:
        """`after` as far as `token` writes the caption as the tokenizer would; empty where it does not: a token
        that ends inside a run of a word's letters where the tokenizer's tokens of that run do not (`_may_end`),
        or one that begins with a letter after a space of its own (the tokenizer writes the space with the
        word, " Now", not " " and "Now"; before digits, alone). A token that ends in a space is allowed only
        where a token that is not a word's may follow it, and leads to states marked `AFTER_SPACE`."""
        data = self.trie.token_bytes[token]
        if spaced and self._space_joins_word and _begins_word(data):
            return frozenset()
        kept = frozenset(s for s in after if s[0] != "word" or self._may_end(self.lattice.forms[s[1]][s[2]].words[s[3]],
                                                                             s[4], data))
        if kept and self._space_joins_word and data.endswith(b" "):
            # (one step on: the automaton has no cycle, every token reads a byte or more of it)
            kept |= {AFTER_SPACE}
            following = self.allowed(kept)
            return kept if any(not _begins_word(self.trie.token_bytes[t]) for t in following if t not in self.eos) \
                else frozenset()
        return kept

    def _may_end(self, word: str, c: int, data: bytes) -> bool:
        """Whether a token `data` may end before character `c` of `word`: not inside a run of letters, or where
        the tokenizer's tokens of that run end, written after a space where the token holds one before it."""
        if not 0 < c < len(word) or not (word[c - 1].isalpha() and word[c].isalpha()):
            return True
        if word not in self._splits:
            self._splits[word] = self._splits_of(word)
        run_start, ends = next((a, e) for a, b, e in self._splits[word] if a < c < b)
        word_bytes = word.encode()
        begins = len(word[:c].encode()) - len(data)  # where the token begins, in the word's bytes
        first = len(word[:run_start].encode())
        if begins < first:  # the token holds the run's first letter: after a space it holds, or none
            before = data[first - begins - 1] if first - begins - 1 >= 0 else None
            return c in ends[" " if before == 0x20 and " " in ends else ""]
        at = len(word_bytes[:begins].decode(errors="ignore"))
        return any((at == run_start or at in e) and c in e for e in ends.values())

    def _splits_of(self, word: str) -> list[tuple[int, int, dict[str, frozenset[int]]]]:
        """Each run of letters in `word` (start, end) with where the tokenizer's tokens of it end inside it
        (character offsets in `word`), written after a space (the first run only) and not; where it does not
        tokenize a run into that run's own bytes, anywhere."""
        out = []
        for run in _LETTERS.finditer(word):
            ends: dict[str, frozenset[int]] = {}
            for lead in (" ", "") if run.start() == 0 else ("",):
                pieces, text = self._tokens_of(lead + run.group()), run.group().encode()
                if b"".join(pieces) != lead.encode() + text:
                    ends[lead] = frozenset(range(run.start(), run.end() + 1))
                    continue
                inside, offset = set(), -len(lead)
                for piece in pieces[:-1]:
                    offset += len(piece)
                    if offset > 0:
                        inside.add(run.start() + len(text[:offset].decode(errors="ignore")))
                ends[lead] = frozenset(inside)
            out.append((run.start(), run.end(), ends))
        return out

    def _tokens_of(self, text: str) -> list[bytes]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        return [self.trie.token_bytes.get(i, b"") for i in ids]

    def _walk(self, node: dict, states: frozenset[State], out: dict[int, frozenset[State]]) -> None:
        for byte, after in self.automaton.next_bytes(states).items():
            child = node.get(byte)
            if child is None:
                continue
            for token in child.get(None, ()):
                out[token] = after
            self._walk(child, after, out)

    def advance(self, states: frozenset[State], tokens: Iterable[int]) -> frozenset[State]:
        """The states after `tokens` (empty: a token the caption may not hold, or past its end)."""
        for token in tokens:
            states = self.allowed(states).get(token, frozenset()) if states else states
        return states

    def mask(self, logits: torch.Tensor, states: Sequence[frozenset[State]]) -> torch.Tensor:
        """Logits [rows, V] with every token that row's states do not allow at -inf. A row with no states
        follows a draft token the caption may not hold, which the pass rejects first: it may only end."""
        out = logits.clone()
        for row, row_states in enumerate(states):
            allowed = self.allowed(row_states) if row_states else dict.fromkeys(self.eos)
            keep = torch.tensor(sorted(allowed), dtype=torch.long, device=logits.device)
            masked = torch.full_like(out[row], float("-inf"))
            masked[keep] = out[row, keep]
            out[row] = masked
        return out


def _begins_word(data: bytes) -> bool:
    """Whether a token's bytes begin with a letter (or a character past ASCII: a letter, a curly quote, a dash,
    which byte-level tokenizers write with the space before them)."""
    return data[0] >= 0x80 or chr(data[0]).isalpha()


# -- the independent check ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CaptionFaults:
    """What a caption changed in its transcript beyond the allowed edits."""

    unsaid: list[str]  # the caption's words nobody said (inserted, or standing for other words)
    dropped: list[str]  # the transcript's words the caption left out (fillers and repetitions excepted)


def caption_faults(transcript: str, caption: str, fillers: Iterable[str] = DEFAULT_FILLERS) -> CaptionFaults:
    """Align the caption's words with the transcript's (a numbers' digits with the words they spell, in any of
    their spellings; fillers and immediate repetitions free to drop) at the least count of faults.

    This is a check of a finished caption by dynamic programming over words, written apart from the automaton
    (which it tests): it does not read the lattice's forms, only the spellings of numbers.
    """
    said, written = transcript_tokens(transcript), transcript_tokens(caption)
    said_keys = [_sayings(t) for t in said]
    written_keys = [_sayings(t) for t in written]
    droppable = _droppable(said, [f.split() for f in fillers])
    n, m = len(written), len(said)
    inf = (1 << 30, 0)
    # best[i][j]: (faults, -matched) aligning written[:i] with said[:j]; back[i][j]: where it came from
    best = [[inf] * (m + 1) for _ in range(n + 1)]
    back: list[list[tuple[int, int, str]]] = [[(0, 0, "")] * (m + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0)
    for i in range(n + 1):
        for j in range(m + 1):
            here = best[i][j]
            if here == inf:
                continue

            moves: list[tuple[int, int, int, int, str]] = []  # (to i, to j, faults, words matched, how)
            if i < n:
                moves.append((i + 1, j, 1, 0, "unsaid"))
            if j < m:
                moves += [(i, j + length, 0, 0, "free") for length in droppable.get(j, ())]
                moves.append((i, j + 1, 1, 0, "dropped"))
            moves += [(i + a, j + b, 0, a, "match") for a, b in _spans(written, said, i, j)
                      if _same_words(written_keys[i : i + a], said_keys[j : j + b])]
            for a, b, cost, matched, how in moves:
                score = (here[0] + cost, here[1] - matched)
                if score < best[a][b]:
                    best[a][b], back[a][b] = score, (i, j, how)
    unsaid: list[str] = []
    dropped: list[str] = []
    i, j = n, m
    while i or j:
        pi, pj, how = back[i][j]
        if how == "unsaid":
            unsaid.insert(0, written[pi])
        elif how == "dropped":
            dropped.insert(0, said[pj])
        i, j = pi, pj
    return CaptionFaults(unsaid, dropped)


def unsaid_words(transcript: str, caption: str, fillers: Iterable[str] = DEFAULT_FILLERS) -> list[str]:
    """The caption's words that are not the transcript's after the allowed edits; [] for a faithful caption."""
    return caption_faults(transcript, caption, fillers).unsaid


def _sayings(token: str) -> list[tuple[str, ...]]:
    """A token's spoken forms as word keys: a word its own key; a number each of its spellings."""
    if token[0].isdigit() or token[0] in CURRENCY_SIGNS:
        return [tuple(s) for s in number_spellings(token)]
    return [(word_key(token),)]


def _droppable(said: list[str], fillers: list[list[str]]) -> dict[int, list[int]]:
    """Where the transcript may lose words for free, and how many: a filler (or filler phrase), a repetition."""
    keys = [word_key(t) for t in said]
    out: dict[int, list[int]] = {}
    for j in range(len(keys)):
        lengths = [len(f) for f in fillers if f and keys[j : j + len(f)] == f]
        if j + 1 < len(keys) and keys[j] == keys[j + 1]:
            lengths.append(1)
        if lengths:
            out[j] = lengths
    return out


def _spans(written: list[str], said: list[str], i: int, j: int) -> Iterable[tuple[int, int]]:
    """The (caption words, transcript words) spans worth comparing at (i, j): one for one, and where a number
    stands on either side, up to `MAX_NUMBER_WORDS` words against one or a few."""
    if i >= len(written) or j >= len(said):
        return ()
    numeric = [_is_numeric(written[i]), _is_numeric(said[j])]
    if not any(numeric):
        return ((1, 1),)
    return ((a, b) for a in range(1, min(MAX_NUMBER_WORDS, len(written) - i) + 1)
            for b in range(1, min(MAX_NUMBER_WORDS, len(said) - j) + 1) if a <= 2 or b <= 2)


def _is_numeric(token: str) -> bool:
    return token[0].isdigit() or token[0] in CURRENCY_SIGNS or word_key(token) in _NUMBER_WORDS


def _same_words(left: list[list[tuple[str, ...]]], right: list[list[tuple[str, ...]]]) -> bool:
    """Some spelling of the left tokens, joined, is some spelling of the right ones."""
    return bool(_joined(left) & _joined(right))


def _joined(tokens: list[list[tuple[str, ...]]]) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = {()}
    for sayings in tokens:
        out = {a + b for a in out for b in sayings}
    return out


# -- the transcript as the draft ------------------------------------------------------------------------------

class TranscriptDrafter:
    """A caption's drafter: the transcript's own next tokens, as the ASR wrote them, from wherever the caption
    has got to. A caption is mostly the transcript again, so a pass of the target verifies many of them; the
    draft never leaves the automaton, and the end token is drafted once the transcript is written.

    A point mass (no q): under seeded sampling the committed token at each position is the target's own
    draw (pipeline/llm/sampling.py), so a seeded caption is the same with this drafter as with none.
    """

    name = "transcript"
    model_free = True

    def __init__(self, constraint: TokenConstraint, transcript: str, tokenizer: object, prompt_len: int) -> None:
        self.constraint, self.tokenizer, self.prompt_len = constraint, tokenizer, prompt_len
        spans = [m.span() for m in _TOKEN.finditer(transcript)]
        self._text = transcript
        self._unit_start = [s for s, _ in spans] + [len(transcript.rstrip())]
        self._unit_end = [e for _, e in spans]
        units = constraint.lattice.units
        # the transcript's tokens with what follows each, a word said twice at once written once (as models do)
        self._pieces = ["" if k + 1 < len(units) and units[k] == units[k + 1] else
                        transcript[self._unit_start[k] : self._unit_start[k + 1]] for k in range(len(units))]
        self._seen: list[int] = []
        self._states = constraint.start()
        self._drafted: list[int] = []  # the last draft
        self._streak = 0  # tokens the caption has written in step with the drafts, since it last left them

    def propose(self, context: Sequence[int], k: int) -> Draft:
        reply = context[self.prompt_len :]
        self._follow(reply[len(self._seen) :] if list(reply[: len(self._seen)]) == self._seen else [])
        states = self._states_after(reply)
        if not states or k < 1:
            return EMPTY
        rest = self._remainder(states)
        draft: list[int] = []
        ids = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []  # type: ignore[attr-defined]
        for token in ids[:k]:
            after = self.constraint.allowed(states).get(token)
            if not after:
                break
            draft.append(token)
            states = after
        if len(draft) == len(ids) and len(draft) < k and self.constraint.automaton.accepts(states):
            draft.append(self.constraint.eos[0])
        self._drafted = draft
        # the confidence the draft length is chosen by (draft_length.MatchAcceptance): how long the caption has
        # kept to the transcript, as a suffix drafter's match length says how long its copy has held
        return Draft(tuple(draft), match=max(1, self._streak))

    def _follow(self, committed: Sequence[int]) -> None:
        """The streak after a step that committed `committed`: it grows while the caption takes the drafts."""
        kept = 0
        while kept < min(len(committed), len(self._drafted)) and committed[kept] == self._drafted[kept]:
            kept += 1
        if committed:
            self._streak = self._streak + len(committed) if kept >= min(len(committed), len(self._drafted)) else 0

    def commit(self, context: Sequence[int]) -> None:
        pass

    def _states_after(self, reply: Sequence[int]) -> frozenset[State]:
        """The automaton's states after the reply so far (advanced from the last call's, where it goes on)."""
        if list(reply[: len(self._seen)]) != self._seen:
            self._seen, self._states = [], self.constraint.start()
        self._states = self.constraint.advance(self._states, reply[len(self._seen) :])
        self._seen = list(reply)
        return self._states

    def _remainder(self, states: frozenset[State]) -> str:
        """The transcript's text from where the caption stands: inside a word, its rest; after a word, what the
        ASR wrote after it; after punctuation or a space of the caption's own, the next word (with a space)."""
        best = ""
        lattice = self.constraint.lattice
        for state in states - {AFTER_SPACE}:
            kind, unit = state[0], state[1]
            if kind == "word" and state[3] == 0:  # inside a word: its rest, then what the ASR wrote after it
                form = lattice.forms[unit][state[2]]
                text = form.words[0][state[4] :] + self._after_unit(form.end)
            elif kind == "literal":  # inside a number's digits: their rest, then what follows its words
                form = lattice.forms[unit][state[2]]
                text = form.literal[state[3] :] + self._after_unit(form.end)
            elif kind == "gap" and state[2] == CLOSE and unit > 0:  # just after a word: the ASR's punctuation
                text = self._after_unit(unit)
            elif kind == "gap" and state[2] in ENDS:  # after marks of the caption's own: a space, the next word
                text = " " + self._cased_after(unit, state[6])
            elif kind == "gap":
                text = self._cased_after(unit, state[6]) if state[2] != OPEN else self._after(unit)
            else:
                continue
            if len(text) > len(best):
                best = text
        return best.rstrip()

    def _after(self, unit: int) -> str:
        """The transcript from unit on."""
        return "".join(self._pieces[unit:])

    def _cased_after(self, unit: int, sentence: bool) -> str:
        """The transcript from unit on, its first word cased as the caption writes it there (a sentence's start
        or not: where the caption's marks differ from the transcript's, so may the case)."""
        text = self._after(unit)
        if unit >= len(self._unit_end):
            return text
        said = self._text[self._unit_start[unit] : self._unit_end[unit]]
        for form in self.constraint.lattice.forms[unit]:
            if form.words and form.at_start in (None, sentence) and form.words[0].lower() == said.lower():
                return form.words[0] + text[len(said) :] if text.startswith(said) else text
        return text

    def _after_unit(self, end: int) -> str:
        """What the transcript wrote after unit end - 1: its punctuation, then the units from `end` on."""
        if end == 0 or end > len(self._unit_end):
            return ""
        return self._text[self._unit_end[end - 1] : self._unit_start[end]] + self._after(end)

