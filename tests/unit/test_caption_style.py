"""Broadcast-style cues (pipeline/caption_style.py): each style rule on cues cut from many random word streams
(hypothesis), hand-made line and cue breaks, the checker on cues made to break one rule each, and the documents
read back by webvtt-py and srt."""

from __future__ import annotations

import html
import io
import json
import math
from dataclasses import replace
from datetime import timedelta
from itertools import pairwise

import pytest
import srt
import webvtt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.asr import Word
from pipeline.caption_style import (
    ARTICLES,
    CHILDREN_CHARS_PER_S,
    RULES,
    CueStyle,
    broadcast_cues,
    find_violations,
    style_violations,
    unit_links,
)
from pipeline.captions import Cue, align_caption, json_document, srt_document, webvtt_document

STYLE = CueStyle()
GAP_S = math.ceil(STYLE.min_gap_frames * 1000 / STYLE.frame_rate) / 1000  # 2 frames at 24 fps, whole ms up
EPS = 1e-6


def spoken(text: str, start_s: float = 0.0, chars_per_s: float = 14.0, pause_s: float = 0.0) -> list[Word]:
    """Words said one after another, each taking its length (and a space) at `chars_per_s`."""
    words: list[Word] = []
    t = start_s
    for token in text.split():
        length = (len(token) + 1) / chars_per_s
        words.append(Word(f" {token}", round(t, 3), round(t + length, 3), 0.9))
        t += length + pause_s
    return words


def lines_of(cues: list[Cue]) -> list[tuple[str, ...]]:
    return [c.lines for c in cues]


def rules_broken(cues: list[Cue], style: CueStyle = STYLE) -> set[str]:
    return {v.rule for v in find_violations(cues, style)}


# Line breaks, by hand: the guides' good breaks are taken, the bad ones avoided.

def test_text_that_fits_a_line_stays_on_one_line():
    cues = broadcast_cues([spoken("Hello there, how are you today?")])
    assert lines_of(cues) == [("Hello there, how are you today?",)]
    assert cues[0].text == "Hello there, how are you today?" and cues[0].utterance == 0


def test_a_line_is_broken_after_punctuation_rather_than_in_the_middle():
    cues = broadcast_cues([spoken("I went to the market on Sunday, and bought fresh apples there.")])
    assert lines_of(cues) == [("I went to the market on Sunday,", "and bought fresh apples there.")]


def test_without_punctuation_a_line_is_broken_before_a_preposition_never_after_an_article():
    cues = broadcast_cues([spoken("She will travel to Oxford to buy an automobile for her brother")])
    assert lines_of(cues) == [("She will travel to Oxford", "to buy an automobile for her brother")]


def test_a_clause_boundary_is_preferred_to_a_balanced_cut():
    # Balanced halves would cut "the | basket"; the sentence's clause ends at the comma.
    cues = broadcast_cues([spoken("When the old man had taken the basket, he walked slowly home.")])
    assert lines_of(cues) == [("When the old man had taken the basket,", "he walked slowly home.")]


@pytest.mark.parametrize(("text", "cues"), [
    ("We looked at the figures on Tuesday. They were nothing like what he said.",
     [("We looked at the figures on Tuesday.", "They were nothing like what he said.")]),
    ("It was late. We looked at the figures again on Tuesday evening.",
     [("It was late.",), ("We looked at the figures again", "on Tuesday evening.")]),
    ("Yes. We looked at the figures again.", [("Yes. We looked at the figures again.",)]),  # a short one may
])
def test_a_sentence_ends_at_the_end_of_a_line_not_inside_one(text, cues):
    assert lines_of(broadcast_cues([spoken(text)])) == cues


@pytest.mark.parametrize(("text", "unit"), [
    ("We talked for hours yesterday with Elizabeth Montgomery Fairweather about it", "Elizabeth Montgomery "
                                                                                      "Fairweather"),
    ("I asked the receptionist whether Doctor Jonathan Fitzgerald was in", "Doctor Jonathan Fitzgerald"),
    ("Then Mr. Anderson arrived at the station with all of his luggage", "Mr. Anderson"),
    ("The tickets cost us exactly twenty five dollars and fifty cents each", "twenty five dollars"),
    ("We agreed to meet outside the old cinema at 3:30 pm on the corner", "3:30 pm"),
    ("They finally sold the house last week for $ 250,000 after a year", "$ 250,000"),
    ("The committee counted one hundred and twenty seven votes in favour", "one hundred and twenty seven"),
])
def test_a_name_or_a_number_is_never_split_over_lines_or_cues(text, unit):
    cues = broadcast_cues([spoken(text)])
    assert [line for c in cues for line in c.lines if unit in line], lines_of(cues)
    assert not rules_broken(cues) & {"name split", "number split"}


def test_names_and_numbers_are_found_without_a_parser():
    words = "Then Mary met John Smith, and Dr. Who at twenty five past 3 pm for $ 25 . One hundred and five".split()
    links = dict(enumerate(unit_links(words)))
    assert links[0] is None and links[1] is None  # a capital at a sentence's start says nothing
    assert links[3] == "name" and links[4] is None  # "John Smith," then a comma
    assert links[6] == "name"  # a title and the name after it
    assert links[9] == "number" and links[12] == "number" and links[15] == "number"  # "twenty five", "3 pm", "$ 25"
    assert [links[k] for k in (18, 19, 20)] == ["number"] * 3  # "One hundred and five"
    assert links[16] is None and links[17] is None  # "25 ." ends a sentence


def test_a_new_cue_starts_at_each_utterance_even_where_one_cue_would_hold_both():
    first = spoken("Are you coming?")
    second = spoken("In a minute.", start_s=first[-1].end_s + 1.0)
    cues = broadcast_cues([first, second])
    assert lines_of(cues) == [("Are you coming?",), ("In a minute.",)]
    assert [c.utterance for c in cues] == [0, 1]


# Timing: the cue starts with its first word, stays up as long as reading needs, and gives way to the next.

def test_a_cue_starts_with_its_first_word_and_stays_for_the_reading_time():
    words = spoken("Absolutely extraordinary circumstances.", chars_per_s=40)  # said fast
    cue = broadcast_cues([words])[0]
    chars = len("Absolutely extraordinary circumstances.")
    assert cue.start_s == words[0].start_s
    assert cue.end_s == pytest.approx(math.ceil(chars * 1000 / 17) / 1000)  # past its last word: reading time
    assert cue.end_s > words[-1].end_s


def test_a_short_cue_stays_for_the_minimum_duration():
    words = spoken("Yes.", start_s=2.0)
    cue = broadcast_cues([words])[0]
    assert cue.start_s == 2.0 and cue.end_s == pytest.approx(2.0 + 0.834)


def test_reading_time_extends_into_the_gap_but_keeps_two_frames_before_the_next_cue():
    first = spoken("Absolutely extraordinary circumstances.", chars_per_s=40)
    second = spoken("Indeed.", start_s=first[-1].end_s + 0.5)
    cues = broadcast_cues([first, second])
    assert cues[0].end_s == pytest.approx(second[0].start_s - GAP_S)
    assert cues[1].start_s == second[0].start_s
    assert "reading speed" in rules_broken(cues)  # 0.5 s was not enough, and it is said


def test_where_a_cue_cannot_stay_longer_the_utterance_is_cut_differently():
    # "Yes." is a sentence of its own, but the next word follows at once: as its own cue it would show 0.2 s.
    words = spoken("Yes. I think we should go to the market now and buy some fresh bread for the party tonight.")
    cues = broadcast_cues([words])
    assert style_violations(cues) == []
    assert cues[0].text.startswith("Yes. I think")


def test_children_read_slower():
    words = spoken("Absolutely extraordinary circumstances.", chars_per_s=40)
    adult, child = broadcast_cues([words])[0], broadcast_cues([words], CueStyle.children())[0]
    assert CueStyle.children().max_chars_per_s == CHILDREN_CHARS_PER_S == 13
    assert child.end_s - child.start_s > adult.end_s - adult.start_s
    assert style_violations([child], CueStyle.children()) == []


def test_an_utterance_spoken_over_more_than_seven_seconds_is_cut():
    words = spoken("so we waited and waited and then it rained", chars_per_s=3.5)  # 12.6 s, 43 characters
    cues = broadcast_cues([words])
    assert len(cues) >= 2 and style_violations(cues) == []
    assert all(c.end_s - c.start_s <= 7.0 for c in cues)


def test_a_word_longer_than_a_line_takes_a_line_of_its_own_and_is_reported():
    long_word = "Pneumonoultramicroscopicsilicovolcanoconiosis-like"
    cues = broadcast_cues([spoken(f"It was {long_word} indeed", chars_per_s=10)])
    assert lines_of(cues) == [("It was", long_word), ("indeed",)]
    assert [(v.rule, v.cue) for v in find_violations(cues)] == [("line length", 0)]


def test_overlapping_utterances_wait_for_each_other_and_never_show_a_word_early():
    first = spoken("I was just about to say the very same thing", start_s=1.0)
    second = spoken("Me too!", start_s=2.0)  # said while the first speaker talks
    cues = broadcast_cues([second, first])  # and given out of order
    assert [c.utterance for c in cues] == [1, 0]
    assert cues[1].start_s >= cues[0].end_s + GAP_S - EPS
    assert cues[1].start_s > second[0].start_s  # later than said, never earlier
    assert not rules_broken(cues) & {"order", "gap", "early"}


def test_word_times_are_kept_as_spoken():
    words = [Word(w.text, w.start_s + 0.0004, w.end_s + 0.0004, 0.9)
             for w in spoken("The rain in Spain stays mainly in the plain.", start_s=0.123)]
    cue = broadcast_cues([words])[0]
    assert [w.text for w in cue.words] == [w.text.strip() for w in words]
    assert [w.start_s for w in cue.words] == [math.ceil(w.start_s * 1000 - EPS) / 1000 for w in words]
    assert cue.start_s == cue.words[0].start_s == 0.124  # whole ms, rounded up: never earlier than said


def test_the_cleaned_captions_words_from_align_caption_cut_like_asr_words():
    heard = spoken("um so twenty five people came to the the party on saturday")
    timed = align_caption("So 25 people came to the party on Saturday.", heard)
    cues = broadcast_cues([timed])
    assert [c.text for c in cues] == ["So 25 people came to the party on Saturday."]
    assert cues[0].start_s == timed[0].start_s and style_violations(cues) == []


# The checker: each rule on its own, on cues made to break it.

def cue(start: float, end: float, *lines: str, utterance: int = 0, words: tuple[Cue, ...] = ()) -> Cue:
    return Cue(start, end, " ".join(lines), lines=lines, utterance=utterance, words=words)


@pytest.mark.parametrize(("cues", "broken"), [
    ([cue(3.0, 4.0, "Hello."), cue(1.0, 2.0, "Again.")], [("order", 1), ("gap", 1)]),  # before: overlaps too
    ([cue(1.0, 2.0, "Hello."), cue(2.05, 3.0, "Again.")], [("gap", 1)]),
    ([cue(1.0, 5.0, "One.", "Two.", "Three.")], [("lines", 0)]),
    ([cue(1.0, 5.0, "This line is much longer than forty-two characters.")], [("line length", 0)]),
    ([cue(1.0, 1.5, "Hi.")], [("min duration", 0)]),
    ([cue(1.0, 8.5, "Hi.")], [("max duration", 0)]),
    ([cue(1.0, 2.0, "Far too many characters in one second.")], [("reading speed", 0)]),
    ([cue(1.0, 2.0, "Hi.", words=(Cue(1.2, 1.4, "Hi."),))], [("early", 0)]),
    ([cue(1.0, 4.0, "We met Elizabeth", "Montgomery at lunch.")], [("name split", 0)]),
    ([cue(1.0, 3.0, "We met Elizabeth"), cue(3.1, 6.0, "Montgomery at lunch.")], [("name split", 0)]),
    ([cue(1.0, 4.0, "It cost me twenty", "five dollars.")], [("number split", 0)]),
    ([cue(1.0, 4.0, "I saw the", "dog in the garden.")], [("article break", 0)]),
])
def test_each_rule_is_checked_on_its_own(cues, broken):
    assert {rule for rule, _ in broken} <= set(RULES)
    assert [(v.rule, v.cue) for v in find_violations(cues)] == broken
    assert [s.split(":")[:2] for s in style_violations(cues)] == [[f"cue {n}", f" {rule}"] for rule, n in broken]


def test_a_split_between_utterances_is_no_split():
    cues = [cue(1.0, 3.0, "We met Elizabeth", utterance=0), cue(3.1, 6.0, "Montgomery at lunch.", utterance=1)]
    assert find_violations(cues) == []


# Random word streams: every rule, on every stream hypothesis makes.

COMMON = ("the a an of to and in that it with for on at by from but or as I you he she we they is was were have "
          "had will would can could not never very really just so then because if when where who which some my "
          "your their this these big old new friendly red house dog river morning ticket doctor garden station "
          "wonderful important reasonable suddenly running waited").split()
NAME_PARTS = ("Mary John Smith Elizabeth Montgomery Fairweather Jo Li Al Oxford Paris Thames Washington "
              "Christopherson Vanderbilt").split()
NUMBERS = ["$25", "3:30", "1,000", "42", "25%", "twenty five", "one hundred and five", "five dollars", "7 pm",
           "$ 25", "twenty first", "three point five"]
PUNCTUATION = ["", "", "", "", ",", ".", "?", "!", ";"]


KINDS = ["common"] * 6 + ["name", "number", "long"]
WORD_PAUSES_S = [0.0, 0.0, 0.1, 0.4, 1.0, 3.0, 8.0]  # after a word (any speech)
PHRASE_PAUSES_S = [0.0, 0.0, 0.05, 0.2, 0.5]  # after a phrase (comfortable speech)
# A phrase: its kind, which one (an index into its list), its punctuation, a capital or not, its pace, a pause.
PHRASE = st.tuples(st.integers(0, len(KINDS) - 1), st.integers(0, 2**16), st.sampled_from(PUNCTUATION),
                   st.booleans(), st.floats(0.0, 1.0), st.integers(0, len(WORD_PAUSES_S) - 1))
UTTERANCE = st.tuples(st.lists(PHRASE, min_size=1, max_size=30), st.floats(0.0, 1.0))


def phrase_tokens(kind: int, pick: int, punctuation: str, capital: bool, long_words: bool) -> list[str]:
    """Words in a row: a common word, a name of one to three capitalised words, a number, or an odd long word."""
    name = KINDS[kind] if long_words or KINDS[kind] != "long" else "common"
    if name == "common":
        tokens = [COMMON[pick % len(COMMON)]]
        tokens[0] = tokens[0].capitalize() if capital else tokens[0]
    elif name == "name":
        tokens = [NAME_PARTS[(pick >> (4 * k)) % len(NAME_PARTS)] for k in range(1 + pick % 3)]
    elif name == "number":
        tokens = NUMBERS[pick % len(NUMBERS)].split()
    else:
        tokens = ["x" * (10 + pick % 51)]
    tokens[-1] += punctuation
    return tokens


def timed_stream(start_s: float, utterances: list[tuple[list[tuple], float]], comfortable: bool) -> list[list[Word]]:
    """Utterances of timed words. Comfortable: each phrase said at 8 to 14 characters a second (a space counted),
    at most half a second between phrases, at least a second between utterances, no word over 20 characters, an
    article always before another word, names and numbers of at most 30 characters and never two in a row: speech
    that every rule can be kept for. Otherwise anything: long words, fast or slow speech, long pauses, overlapping
    utterances, words all said at once."""
    out: list[list[Word]] = []
    t = start_s
    for phrases, gap in utterances:
        words: list[Word] = []
        last_kind = ""
        for kind, pick, punctuation, capital, pace, pause in phrases:
            tokens = phrase_tokens(kind, pick, punctuation, capital, long_words=not comfortable)
            if comfortable and words and (  # no article before an article, names and numbers of 30 characters at most
                    {words[-1].text.strip().lower(), tokens[0].lower()} <= ARTICLES
                    or (words[-1].text.strip()[0].isupper() and tokens[0][0].isupper()) or len(" ".join(tokens)) > 30
                    or {last_kind, KINDS[kind]} <= {"name", "number"}):
                continue
            last_kind = KINDS[kind]
            for token in tokens:
                length = (len(token) + 1) / (8.0 + 6.0 * pace) if comfortable else 1.5 * pace
                words.append(Word(f" {token}", round(t, 3), round(t + length, 3), 0.9))
                t += length + (0.0 if comfortable else WORD_PAUSES_S[pause])
            t += PHRASE_PAUSES_S[pause % len(PHRASE_PAUSES_S)] if comfortable else 0.0
        if comfortable and words[-1].text.strip().lower() in ARTICLES:
            words.append(Word(" end.", round(t, 3), round(t + 0.3, 3), 0.9))
            t += 0.3
        out.append(words)
        t = max(t + (1.0 + 3.0 * gap if comfortable else 7.0 * gap - 3.0), 0.0)
    return out


def streams(comfortable: bool) -> st.SearchStrategy[list[list[Word]]]:
    utterances = st.lists(UTTERANCE, min_size=1 if comfortable else 0, max_size=5)
    return st.tuples(st.floats(0.0, 5.0), utterances).map(lambda s: timed_stream(*s, comfortable=comfortable))


def spoken_ms(seconds: float) -> float:
    return math.ceil(seconds * 1000 - EPS) / 1000


def check_invariants(utterances: list[list[Word]], cues: list[Cue], style: CueStyle) -> None:
    """What holds whatever the words: every word once and in order, an utterance's words together and in cues of
    their own, no cue before its first word, cues in order and 2 frames apart, layout, at most 7 s a cue."""
    order = sorted((u for u in range(len(utterances)) if utterances[u]),
                   key=lambda u: spoken_ms(utterances[u][0].start_s))
    expected = [(u, w.text.strip()) for u in order for w in utterances[u]]
    assert [(c.utterance, w.text) for c in cues for w in c.words] == expected
    gap_s = math.ceil(style.min_gap_frames * 1000 / style.frame_rate) / 1000
    for n, c in enumerate(cues):
        assert c.text == " ".join(c.lines) == " ".join(w.text for w in c.words)
        assert 1 <= len(c.lines) <= style.max_lines
        assert all(len(line) <= style.max_line_chars or " " not in line for line in c.lines)  # a long word alone
        first_said = c.words[0].start_s
        floor = max(first_said, cues[n - 1].end_s + gap_s) if n else first_said
        assert c.start_s == pytest.approx(floor, abs=EPS)  # with its first word, or the gap after the cue before
        assert c.start_s < c.end_s <= c.start_s + style.max_duration_s + EPS
    for a, b in pairwise(cues):
        assert b.start_s - a.end_s >= gap_s - EPS
    for u, words in enumerate(utterances):  # a word's time is as said (whole ms, rounded up), never earlier
        mine = [w for c in cues if c.utterance == u for w in c.words]
        assert all(m.start_s >= w.start_s - EPS for m, w in zip(mine, words, strict=True))


def fits_a_cue(tokens: list[str], style: CueStyle) -> bool:
    """Greedy filling is optimal for whether words fit in so many lines."""
    lines, length = 1, -1
    for token in tokens:
        if len(token) > style.max_line_chars:
            return False
        if length + 1 + len(token) > style.max_line_chars:
            lines, length = lines + 1, -1
        length += 1 + len(token)
    return lines <= style.max_lines


def unit_of(tokens: list[str], links: list[str | None], k: int) -> tuple[int, int]:
    first, last = k, k + 1
    while first > 0 and links[first - 1]:
        first -= 1
    while last < len(links) and links[last]:
        last += 1
    return first, last


def check_splits_are_forced(utterances: list[list[Word]], cues: list[Cue], style: CueStyle) -> None:
    """A name or a number is split only where it cannot fit a line (at a line break) or a cue, or is said over
    longer than a cue may show (at a cue break); and the checker reports each split, and no other."""
    splits = 0
    for u in {c.utterance for c in cues}:
        mine = [c for c in cues if c.utterance == u]
        words = [w for c in mine for w in c.words]
        tokens = [t for w in words for t in w.text.split()]
        owner = [i for i, w in enumerate(words) for _ in w.text.split()]
        links = unit_links(tokens)
        breaks: list[tuple[int, str]] = []  # (the last token before a break, "line" or "cue")
        seen = 0
        for n, c in enumerate(mine):
            for k, line in enumerate(c.lines, start=1):
                seen += len(line.split())
                breaks.append((seen - 1, "line" if k < len(c.lines) else "cue"))
            if n + 1 == len(mine):
                breaks.pop()
        for k, where in breaks:
            if not links[k]:
                continue
            splits += 1
            first, last = unit_of(tokens, links, k)
            unit = tokens[first:last + 1]
            span = words[owner[last]].end_s - words[owner[first]].start_s
            if where == "line":
                assert len(" ".join(unit)) > style.max_line_chars, (unit, where)
            else:
                assert not fits_a_cue(unit, style) or span > style.max_duration_s, (unit, where)
    assert splits == sum(v.rule in ("name split", "number split") for v in find_violations(cues, style))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(comfortable=False))
def test_any_words_keep_the_rules_that_can_be_kept_and_report_the_rest(utterances):
    cues = broadcast_cues(utterances)
    check_invariants(utterances, cues, STYLE)
    check_splits_are_forced(utterances, cues, STYLE)
    for v in find_violations(cues):
        assert v.rule not in ("order", "gap", "lines", "max duration", "early"), v
        c = cues[v.cue]
        if v.rule == "line length":
            assert all(" " not in line for line in c.lines if len(line) > STYLE.max_line_chars), v
        if v.rule in ("min duration", "reading speed"):  # only once the cue stays as long as it may
            following = cues[v.cue + 1].start_s - GAP_S if v.cue + 1 < len(cues) else math.inf
            assert c.end_s == pytest.approx(min(following, c.start_s + STYLE.max_duration_s), abs=EPS), v


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(comfortable=True))
def test_speech_every_rule_can_be_kept_for_gets_cues_that_keep_every_rule(utterances):
    cues = broadcast_cues(utterances)
    check_invariants(utterances, cues, STYLE)
    assert style_violations(cues) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(comfortable=False), st.sampled_from([CueStyle(max_line_chars=32, max_lines=3, frame_rate=25.0),
                                                    CueStyle.children(), CueStyle(min_gap_frames=0)]))
def test_other_styles_keep_their_own_rules(utterances, style):
    cues = broadcast_cues(utterances, style)
    check_invariants(utterances, cues, style)
    check_splits_are_forced(utterances, cues, style)


def independent_violations(cues: list[Cue], style: CueStyle) -> set[tuple[str, int]]:
    """The numeric rules, checked here from their definitions."""
    out: set[tuple[str, int]] = set()
    for n, c in enumerate(cues):
        duration = round((c.end_s - c.start_s) * 1000)
        if n and round((c.start_s - cues[n - 1].end_s) * 1000) < style.min_gap_frames * 1000 / style.frame_rate:
            out.add(("gap", n))
        if duration < style.min_duration_s * 1000 - EPS:
            out.add(("min duration", n))
        if duration > style.max_duration_s * 1000 + EPS:
            out.add(("max duration", n))
        if len(c.text) * 1000 > style.max_chars_per_s * duration:
            out.add(("reading speed", n))
        out |= {("line length", n) for line in c.lines if len(line) > style.max_line_chars}
    return out


@settings(max_examples=150, deadline=None)
@given(streams(comfortable=False), st.floats(0.3, 1.5), st.integers(20, 60))
def test_the_checker_finds_exactly_what_breaks_each_numeric_rule(utterances, stretch, line_chars):
    """Cues cut for one style, checked against another, so that each rule is broken somewhere."""
    cues = broadcast_cues(utterances)
    cues = [replace(c, start_s=round(c.start_s * stretch, 3), end_s=round(c.end_s * stretch, 3)) for c in cues]
    style = CueStyle(max_line_chars=line_chars)
    numeric = {"gap", "min duration", "max duration", "reading speed", "line length"}
    found = {(v.rule, v.cue) for v in find_violations(cues, style) if v.rule in numeric}
    assert found == independent_violations(cues, style)


# The documents: read back by webvtt-py and srt, with the same lines and times; empty input, empty documents.

def assert_documents_read_back(cues: list[Cue]) -> None:
    times = [(round(c.start_s * 1000), round(c.end_s * 1000)) for c in cues]
    vtt = webvtt.from_buffer(io.StringIO(webvtt_document(cues)))
    assert [html.unescape(c.text).split("\n") for c in vtt] == [list(c.lines) for c in cues]
    assert [(ms(c.start), ms(c.end)) for c in vtt] == times
    parsed = list(srt.parse(srt_document(cues)))
    assert [s.content.split("\n") for s in parsed] == [list(c.lines) for c in cues]
    assert [(s.start // timedelta(milliseconds=1), s.end // timedelta(milliseconds=1)) for s in parsed] == times
    assert json.loads(json_document(cues)) == {"cues": [
        {"start": round(c.start_s, 3), "end": round(c.end_s, 3), "lines": list(c.lines),
         "words": [{"text": w.text, "start": round(w.start_s, 3), "end": round(w.end_s, 3)} for w in c.words],
         "utterance": c.utterance}
        for c in cues]}


def ms(timestamp: str) -> int:
    hms, frac = timestamp.split(".")
    h, m, s = (int(x) for x in hms.split(":"))
    return ((h * 60 + m) * 60 + s) * 1000 + int(frac)


def test_two_line_cues_read_back_as_two_lines():
    cues = broadcast_cues([spoken("I went to the market on Sunday, and bought fresh apples & pears <cheap>.")])
    assert len(cues[0].lines) == 2
    assert_documents_read_back(cues)
    assert "&amp; pears &lt;cheap>" in webvtt_document(cues)


@settings(max_examples=60, deadline=None)
@given(streams(comfortable=False))
def test_every_stream_reads_back_from_each_document(utterances):
    assert_documents_read_back(broadcast_cues(utterances))


@pytest.mark.parametrize("utterances", [[], [[]], [[Word("  ", 1.0, 1.2, 0.9)]]])
def test_no_words_give_empty_valid_documents(utterances):
    cues = broadcast_cues(utterances)
    assert cues == []
    assert webvtt_document(cues) == "WEBVTT\n" and list(webvtt.from_buffer(io.StringIO(webvtt_document(cues)))) == []
    assert srt_document(cues) == "" and list(srt.parse(srt_document(cues))) == []
    assert json.loads(json_document(cues)) == {"cues": []}
    assert style_violations(cues) == []


def test_a_style_that_cannot_be_kept_is_refused():
    with pytest.raises(ValueError):
        CueStyle(min_duration_s=8.0)
    with pytest.raises(ValueError):
        CueStyle(max_line_chars=0)
