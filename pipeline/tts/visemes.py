"""Visemes: the mouth shapes an avatar takes while a reply is spoken, timed from the voice's phonemes.

The set is the 15 visemes of Meta's Oculus Lipsync (sil, PP, FF, TH, DD, kk, CH, SS, nn, RR, aa, E,
ih, oh, ou), the primary id of every event. It is the set avatar rigs ship blend shapes for (Oculus
Lipsync for Unity and Unreal, and the `viseme_*` morph targets of Ready Player Me and most glTF/VRM
avatars), and it is cut by mouth shape rather than by one language's phoneme inventory. Each event
also carries the id Microsoft's Azure Speech gives the same sound (its 22 ids, 0-21), for rigs built
for Azure's viseme events; it is taken from the phoneme itself, not from the Meta viseme, since the
two sets group sounds differently (Azure's 19 holds d, t, n and θ, which Meta splits into DD, nn
and TH; Azure has ids of their own for h and for the diphthongs aɪ, aʊ, ɔɪ).

Sources: Meta, "Viseme Reference" (Oculus Lipsync for Unity, developers.meta.com/horizon/documentation/
unity/audio-ovrlipsync-viseme-reference); Microsoft, "Get facial position with viseme", its table
mapping en-US phonemes to viseme ids (learn.microsoft.com/azure/ai-services/speech-service/
how-to-speech-synthesis-viseme). docs/avatars.md has the whole table.

Phonemes are espeak-ng's IPA, one Unicode code point at a time as Piper's voices take them (Piper's
phoneme map; a voice may also join some into clusters such as "aɪ"). Every code point of that map has
a place here; any other symbol gets the nearest class by its Unicode name, so nothing is refused.
- Stress marks (ˈ ˌ) give their time to the sound after them, length marks and diacritics (ː ̩ ʰ …)
  to the sound before them, and a word separator to the sound before it: they make no shape.
- Affricates (tʃ, dʒ) are one CH. Diphthongs (aɪ, aʊ, ɔɪ, oʊ, eɪ, əʊ) are split where the voice split
  them: the first vowel's shape, then the glide's at `GLIDE_WEIGHT` (an offglide does not reach its
  target), both with the diphthong's Azure id.
- h and the other glottal and pharyngeal sounds have no shape of their own: they take the next
  sound's at `BREATH_WEIGHT` (the mouth is already set for the vowel); reduced vowels (ə, ɐ, ᵻ) are
  at `REDUCED_WEIGHT`. `weight` is how far the mouth takes the shape, 0 to 1.
- Punctuation, Piper's ^ $ _ marks and pauses are sil.

Timing: `visemes_from_alignment` takes a sentence's (phoneme, samples) alignment, the durations the
voice itself gave each phoneme, and returns visemes that tile it exactly. A voice that does not align
its output (Coqui) gets `proportional_alignment`: its phonemes spread over the audio's voiced span in
proportion to typical durations, the visemes marked approximate.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["AZURE_IDS", "META_VISEMES", "Shape", "Viseme", "proportional_alignment", "shape_of", "starting_in",
           "visemes_from_alignment"]

META_VISEMES = ("sil", "PP", "FF", "TH", "DD", "kk", "CH", "SS", "nn", "RR", "aa", "E", "ih", "oh", "ou")
AZURE_IDS = range(22)
GLIDE_WEIGHT = 0.6  # a diphthong's second part: the glide toward a vowel it does not reach
BREATH_WEIGHT = 0.5  # h: the next sound's shape, begun
REDUCED_WEIGHT = 0.6  # ə and its kind: a short, lax opening


@dataclass(frozen=True)
class Shape:
    viseme: str  # one of META_VISEMES
    azure_id: int  # Azure's viseme id, 0-21
    weight: float = 1.0


SILENCE = Shape("sil", 0)


@dataclass(frozen=True)
class Viseme:
    """A mouth shape held from `start_s` to `end_s` (seconds from the start of the audio it belongs to)."""

    start_s: float
    end_s: float
    viseme: str  # Meta's name: "sil", "PP", ... (META_VISEMES)
    azure_id: int
    weight: float = 1.0
    approximate: bool = False  # timed in proportion, not by the voice's own alignment


def _shapes(symbols: str, viseme: str, azure_id: int, weight: float = 1.0) -> dict[str, Shape]:
    return dict.fromkeys(symbols, Shape(viseme, azure_id, weight))


# Every speech sound of Piper's espeak phoneme map (the voices' phoneme_id_map), by Meta viseme.
SHAPES: dict[str, Shape] = {
    **_shapes("pbmɓʙʘ", "PP", 21),  # lips closed
    **_shapes("fvɸβʋⱱɱ", "FF", 18),  # lower lip to the teeth
    **_shapes("θ", "TH", 19), **_shapes("ð", "TH", 17),  # tongue between the teeth
    **_shapes("tdʈɖɗɾɽʔǀǃǂ", "DD", 19),  # tongue tip stops and flaps (the glottal stop stands for /t/)
    **_shapes("kgɡqɢcɟʄɠʛxɣχʁŋɴ", "kk", 20),  # back of the tongue
    **_shapes("ʃʒɕʑʂʐɧ", "CH", 16),  # lips pushed out
    **_shapes("sz", "SS", 15), **_shapes("ç", "SS", 12),
    **_shapes("nɲɳ", "nn", 19), **_shapes("lɫɬɮɭʎʟɺǁ", "nn", 14),
    **_shapes("ɹrɻʀ", "RR", 13), **_shapes("ɜɚ", "RR", 5),  # r, and the r-coloured vowels of "bird", "letter"
    **_shapes("jʝɰ", "ih", 6), **_shapes("wʍɥ", "ou", 7),
    **_shapes("aɑɶ", "aa", 2), **_shapes("æʌ", "aa", 1), **_shapes("əɐ", "aa", 1, REDUCED_WEIGHT),
    **_shapes("eɛεɘɤ", "E", 4),
    **_shapes("iɪɨɯ", "ih", 6), **_shapes("ᵻ", "ih", 6, REDUCED_WEIGHT),
    **_shapes("uyʏʉ", "ou", 7), **_shapes("ʊ", "ou", 4),
    **_shapes("oɵø", "oh", 8), **_shapes("ɔɒœɞ", "oh", 3),
}
BREATHS = frozenset("hɦħʕʜʢʡ")  # no shape of their own: the next sound's, begun (Azure's 12)
BREATH_AZURE_ID = 12
AFFRICATES = {("t", "ʃ"): Shape("CH", 16), ("d", "ʒ"): Shape("CH", 16)}
DIPHTHONG_AZURE_IDS = {("a", "ɪ"): 11, ("a", "ʊ"): 9, ("ɔ", "ɪ"): 10, ("o", "ʊ"): 8, ("e", "ɪ"): 4, ("ə", "ʊ"): 8}
STRESS = frozenset("ˈˌ")  # before the vowel they stress: their time is that vowel's
WORD_JOINS = frozenset(" '-")  # between words: the time goes to the sound before
PAUSES = frozenset("^$_")  # Piper's sentence marks and pad (punctuation is a pause by its Unicode category)
MARKS = frozenset("ːˑ˞ˤʰʲ↓↑")  # length, r-colouring, secondary articulations, tone: part of the sound before
# What a letter's Unicode name says it is a form of ("LATIN SMALL LETTER TURNED R" is an r).
NAME_WORDS_SKIPPED = frozenset({"LATIN", "GREEK", "SMALL", "CAPITAL", "LETTER", "TURNED", "REVERSED", "OPEN",
                                "CLOSED", "BARRED", "DOTLESS", "SCRIPT", "LONG", "SIDEWAYS", "MODIFIER"})
UNKNOWN = Shape("DD", 19)  # a letter with no known kind: a consonant, the mouth nearly at rest


def shape_of(symbol: str) -> Shape | None:
    """The mouth shape of one speech sound; None for a mark that makes none (stress, length, pauses).

    Symbols not in Piper's map get the nearest class: a precomposed letter its base letter's,
    another letter that of the letter its Unicode name says it is a form of.
    """
    if symbol in SHAPES:
        return SHAPES[symbol]
    if symbol in BREATHS:
        return Shape("sil", BREATH_AZURE_ID)  # in a sentence: the next sound's shape (`_resolve_breaths`)
    if _kind(symbol) != "speech":
        return None
    base = unicodedata.normalize("NFD", symbol)[0]
    if base in SHAPES:
        return SHAPES[base]
    words = unicodedata.name(base, "").split()
    letters = [w.lower() for w in words if w not in NAME_WORDS_SKIPPED and len(w) == 1]
    return SHAPES.get(letters[0], UNKNOWN) if letters else UNKNOWN


def _kind(symbol: str) -> str:
    """speech; stress (its time goes to the next sound); word_join and joins_previous (to the sound
    before); or pause."""
    if symbol in SHAPES or symbol in BREATHS:
        return "speech"
    if symbol in STRESS:
        return "stress"
    if symbol in PAUSES:
        return "pause"
    if symbol in WORD_JOINS:
        return "word_join"
    category = unicodedata.category(symbol[0]) if symbol else "Zs"
    if symbol in MARKS or category[0] == "M" or category in ("Lm", "Sk"):
        return "joins_previous"
    return "speech" if category[0] == "L" else "pause"


@dataclass
class _Sound:
    """A stretch of the alignment with one mouth shape (None: a pause), in samples."""

    shape: Shape | None
    start: int
    end: int
    breath: bool = False  # h: takes the next sound's shape


def _code_points(alignment: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """One entry per code point: a cluster ("aɪ") shares its samples evenly among its code points."""
    out: list[tuple[str, int]] = []
    for symbol, samples in alignment:
        points = list(symbol) or [symbol]
        shares = np.diff(np.round(np.linspace(0, samples, len(points) + 1))).astype(int)
        out += [(p, int(n)) for p, n in zip(points, shares, strict=True)]
    return out


def _sounds(alignment: Sequence[tuple[str, int]]) -> list[_Sound]:
    """The alignment cut into sounds that tile it: every sample belongs to one."""
    sounds: list[_Sound] = []
    position, stressed_from, previous = 0, -1, ""  # previous: the code point just before, if speech
    for symbol, samples in _code_points(alignment):
        kind, end = _kind(symbol), position + samples
        last = sounds[-1] if sounds else None
        if kind == "stress":
            stressed_from = position if stressed_from < 0 else stressed_from
        elif kind in ("joins_previous", "word_join") and last is not None and stressed_from < 0:
            last.end = end
        elif kind == "speech":
            start = stressed_from if stressed_from >= 0 else position
            if last is not None and (previous, symbol) in AFFRICATES and start == last.end:
                last.shape, last.end = AFFRICATES[(previous, symbol)], end
            else:
                sounds.append(_Sound(shape_of(symbol), start, end, breath=symbol in BREATHS))
                if last is not None and (diphthong := DIPHTHONG_AZURE_IDS.get((previous, symbol))) is not None:
                    _join_diphthong(last, sounds[-1], diphthong)
            stressed_from = -1
        else:  # a pause, or a mark with no sound before it
            start = stressed_from if stressed_from >= 0 else position
            if last is not None and last.shape is None:
                last.end = end
            else:
                sounds.append(_Sound(None, start, end))
            stressed_from = -1
        previous = symbol if kind == "speech" else ""
        position = end
    if stressed_from >= 0:  # a stress mark with nothing after it
        sounds.append(_Sound(None, stressed_from, position))
    return sounds


def _join_diphthong(first: _Sound, glide: _Sound, azure_id: int) -> None:
    """A diphthong: the first vowel's shape, then the glide's, lighter; both Azure's id of the whole."""
    assert first.shape is not None and glide.shape is not None
    first.shape = Shape(first.shape.viseme, azure_id, first.shape.weight)
    glide.shape = Shape(glide.shape.viseme, azure_id, round(glide.shape.weight * GLIDE_WEIGHT, 3))


def _resolve_breaths(sounds: list[_Sound]) -> None:
    """h and its kind take the shape of the nearest sound after them, begun (a pause after: silence)."""
    target: Shape | None = None  # the shape of the nearest speech sound after; None past a pause
    for sound in reversed(sounds):
        if sound.breath:
            sound.shape = (Shape(target.viseme, BREATH_AZURE_ID, round(target.weight * BREATH_WEIGHT, 3))
                           if target is not None else Shape("sil", BREATH_AZURE_ID))
        else:
            target = sound.shape


def visemes_from_alignment(alignment: Sequence[tuple[str, int]], sample_rate_hz: int,
                           approximate: bool = False) -> tuple[Viseme, ...]:
    """Visemes that tile a sentence's audio, from its (phoneme, samples) alignment.

    The alignment is Piper's (`PiperSynthesizer._phoneme_samples`: each phoneme's samples, its
    pad included, from the ^ mark to the $ mark), or one made by `proportional_alignment`.
    Times are seconds from the alignment's first sample; neighbours with the same shape merge.
    """
    sounds = _sounds(alignment)
    _resolve_breaths(sounds)
    out: list[Viseme] = []
    for sound in sounds:
        shape = sound.shape or SILENCE
        if sound.end <= sound.start:
            continue
        last = out[-1] if out else None
        if last is not None and (last.viseme, last.azure_id, last.weight) == (shape.viseme, shape.azure_id,
                                                                            shape.weight):
            out[-1] = Viseme(last.start_s, sound.end / sample_rate_hz, last.viseme, last.azure_id, last.weight,
                             approximate)
        else:
            out.append(Viseme(sound.start / sample_rate_hz, sound.end / sample_rate_hz, shape.viseme,
                              shape.azure_id, shape.weight, approximate))
    return tuple(out)


# Typical lengths in relative units, for proportional timing: a vowel is about twice a consonant
# (English segment durations: vowels ~100 ms, consonants ~50-80 ms), a clause pause longer still.
VOWELS = frozenset("aɑɶæʌəɐeɛεɘɤiɪɨɯᵻuyʏʉʊoɵøɔɒœɞɜɚ")
TYPICAL_LENGTH = {"vowel": 2.0, "speech": 1.2, "pause": 3.0, "word_join": 0.3, "joins_previous": 1.0, "stress": 0.0}
SILENCE_BELOW_DB = -35.0  # a 10 ms frame this far below the loudest one is silence (lead-in and tail)


def proportional_alignment(phonemes: Sequence[str], audio: np.ndarray, sample_rate_hz: int) -> list[tuple[str, int]]:
    """An alignment for a voice that gives none: the audio's leading and trailing silence as
    Piper's ^ and $ marks, and the phonemes spread over the voiced span between in proportion to
    their typical lengths (`TYPICAL_LENGTH`). Its visemes are approximate."""
    first, last = _voiced_span(audio, sample_rate_hz)
    lengths = np.array([TYPICAL_LENGTH["vowel"] if p in VOWELS else TYPICAL_LENGTH[_kind(p)] for p in phonemes])
    if not phonemes or lengths.sum() <= 0:
        return [("^", first), ("$", audio.size - first)]
    edges = np.round(first + (last - first) * np.concatenate([[0.0], np.cumsum(lengths)]) / lengths.sum())
    samples = np.diff(edges).astype(int)
    return [("^", first), *((p, int(n)) for p, n in zip(phonemes, samples, strict=True)), ("$", audio.size - last)]


def _voiced_span(audio: np.ndarray, sample_rate_hz: int) -> tuple[int, int]:
    """(first, end) sample of the audio louder than `SILENCE_BELOW_DB` under its loudest 10 ms."""
    frame = max(1, sample_rate_hz // 100)
    frames = audio.size // frame
    if frames == 0:
        return 0, audio.size
    rms = np.sqrt(np.mean(audio[: frames * frame].reshape(frames, frame).astype(np.float64) ** 2, axis=1))
    loud = np.flatnonzero(rms > max(rms.max() * 10 ** (SILENCE_BELOW_DB / 20), 1e-5))
    if loud.size == 0:
        return 0, audio.size
    return int(loud[0] * frame), min(audio.size, int((loud[-1] + 1) * frame))


def starting_in(visemes: Sequence[Viseme], start_s: float, end_s: float | None) -> tuple[Viseme, ...]:
    """The visemes that start in [start_s, end_s) of their audio (None: to its end), timed from start_s."""
    return tuple(Viseme(v.start_s - start_s, v.end_s - start_s, v.viseme, v.azure_id, v.weight, v.approximate)
                 for v in visemes if start_s <= v.start_s and (end_s is None or v.start_s < end_s))
