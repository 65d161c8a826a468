"""Which words of a whisper pass the speaker said (pipeline/asr_words.py), on passes written here
with the measures whisper gave the recorded cases (tests/e2e/test_asr_stream.py runs the model)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.asr import AsrOptions, Transcript, Utterance, Word, said_again
from pipeline.asr_words import heard_as_words, spoken_words, utterance_words, without_loop


def words(text: str, start_s: float = 0.5, step_s: float = 0.2, probability: float = 0.9) -> tuple[Word, ...]:
    return tuple(Word(f" {t}", start_s + i * step_s, start_s + (i + 1) * step_s, probability)
                 for i, t in enumerate(text.split()))


def texts(ws) -> list[str]:
    return [w.text.strip() for w in ws]


def utterance(voiced_s: float) -> Utterance:
    return Utterance(0, speech_start_s=0.5, speech_end_s=0.5 + voiced_s, audio=np.zeros(1, np.float32))


def pass_of(said: tuple[Word, ...], no_speech_prob: float = 0.1, avg_logprob: float = -0.5) -> Transcript:
    return Transcript("".join(w.text for w in said).strip(), said, no_speech_prob, avg_logprob, 1.0)


def test_a_loop_at_the_end_is_kept_once():
    assert texts(without_loop(words("and anthem and anthem and anthem"), 3)) == ["and", "anthem"]
    assert texts(without_loop(words("Stop Stop Stop Stop"), 3)) == ["Stop"]
    assert texts(without_loop(words("tell me about the moon the moon the moon"), 3)) == ["tell", "me", "about",
                                                                                       "the", "moon"]
    # Two copies may be said ("bye bye", "go on, go on"), a copy with one word changed is no loop.
    assert texts(without_loop(words("bye bye"), 3)) == ["bye", "bye"]
    assert texts(without_loop(words("yes yes yes yep"), 3)) == ["yes", "yes", "yes", "yep"]
    assert texts(without_loop(words("yes yes yes"), 0)) == ["yes", "yes", "yes"]  # off
    assert texts(without_loop(words("Yes. yes, YES"), 3)) == ["Yes."]  # compared as norm_word compares


def test_a_hums_spelling_is_no_word():
    options = AsrOptions()
    for hum in ("Mm-hmm.", "MMMM", "mhm. mhm.", "M-M-M", "Hmm?", "mm-hmm. mm-h."):
        said = words(hum)
        assert not heard_as_words(pass_of(said), said, utterance(0.7), options), hum
        assert not heard_as_words(pass_of(said), said, utterance(2.5), options), hum  # at any length
    # Words beside a hum's spelling in a short utterance are whisper's guesses at the hum ...
    guess = words("and anthem. mm-hmm. mm-huh.")
    assert not heard_as_words(pass_of(guess), guess, utterance(0.67), options)
    # ... and in a longer one, words said around a hum.
    said = words("mm-hmm, I think that is right")
    assert heard_as_words(pass_of(said), said, utterance(1.4), options)


def test_an_unsure_short_pass_is_no_word_and_a_sure_one_is():
    options = AsrOptions()  # short: < 1 s voiced; unsure: no-speech >= 0.25 and log probability < -1.1
    hum_as_word = words("them", probability=0.06)  # a hummed "Hmm." (espeak en-gb+f3): 0.46, -1.35
    assert not heard_as_words(pass_of(hum_as_word, 0.46, -1.35), hum_as_word, utterance(0.35), options)
    hello = words("Hello?", probability=0.28)  # a real "Hello?" (espeak en-us+m3): 0.49, -1.04
    assert heard_as_words(pass_of(hello, 0.49, -1.04), hello, utterance(0.45), options)
    # The same measures on a longer utterance: judged by its words alone.
    assert heard_as_words(pass_of(hum_as_word, 0.46, -1.35), hum_as_word, utterance(1.2), options)
    off = AsrOptions(short_utterance_ms=0)
    assert heard_as_words(pass_of(hum_as_word, 0.46, -1.35), hum_as_word, utterance(0.35), off)


def test_an_utterances_words_drop_whispers_additions_then_judge_what_is_left():
    options = AsrOptions()
    said = words("Thank you very much.", start_s=0.5, step_s=0.24)  # speech 0.5-1.46
    crammed = tuple(Word(w.text, 1.5, 1.5, 0.97) for w in said)  # the utterance once more, at its end
    assert texts(utterance_words(pass_of(said + crammed), utterance(0.96), options)) == texts(said)
    # While the user speaks, nothing at the edge is dropped; a hum is no word either way.
    assert len(utterance_words(pass_of(said + crammed), utterance(0.96), options, ended=False)) == 4
    hum = words("Mm-hmm.")
    assert utterance_words(pass_of(hum), utterance(0.5), options, ended=False) == ()
    assert utterance_words(pass_of(()), utterance(0.5), options) == ()


def test_a_pass_given_words_before_keeps_only_the_words_after_them() -> None:
    """`Transcriber.transcribe(before=…)`: whisper's result spells the prefix it was given, then its own
    words; the prefix's words go, a word begun inside the prefix goes too, and emptied segments go."""
    from pipeline.asr import _after_text

    def segment(*spelled: str) -> dict:
        return {"start": 0.0, "end": 1.0, "words": [{"word": w, "start": 0.0, "end": 1.0} for w in spelled]}

    segments = [segment(" I", " have", " a", " question."), segment(" How", " do", " volcanoes", " form?")]
    prefix = len(" I have a question.")
    kept = _after_text(segments, prefix)
    assert [[w["word"] for w in s["words"]] for s in kept] == [[" How", " do", " volcanoes", " form?"]]
    assert _after_text(segments, 0) is segments
    straddling = [segment(" I", " have", " a", " questions", " now.")]  # "questions" begun in the prefix
    assert [w["word"] for w in _after_text(straddling, len(" I have a question"))[0]["words"]] == [" now."]
    assert _after_text(segments, 10_000) == []


def test_a_pass_that_says_the_words_before_once_more_keeps_the_words_after_them() -> None:
    """`said_again`: going on from "So this is the." whisper wrote "So this is the sixth form." with
    "So" and "this" at the instant the audio before ends (mfa-cold-corpus, whisper tiny.en)."""
    from pipeline.asr import said_again

    before = words("uh so this is the.", start_s=1.7, step_s=0.15)
    crammed = (Word(" So", 2.41, 2.41, 0.6), Word(" this", 2.41, 2.41, 0.7), Word(" is", 2.41, 2.45, 0.8),
               Word(" the", 2.45, 2.97, 0.8))
    new = words("sixth form.", start_s=2.97)
    assert said_again(before, crammed + new) == 4
    # A repetition the speaker made is timed like any word: it stays.
    assert said_again(before, words("the the sixth form.", start_s=2.9)) == 0
    # Words that are not the last words before, or come after new ones, stay too.
    assert said_again(before, (Word(" So", 2.41, 2.41, 0.6),) + new) == 0
    assert said_again(before, new + crammed) == 0
    assert said_again((), crammed) == 0 and said_again(before, ()) == 0


def test_a_copy_one_word_off_crammed_into_an_instant_is_whispers():
    """Whisper tiny wrote "the reporting environment is also quite different. The reporting environment is also a
    quite different.", the copy's words all at one instant but its last (mfa-cold-corpus, its 6 s cap)."""
    options = AsrOptions()
    said = words("the reporting environment is also quite different.", start_s=9.6, step_s=0.4)  # to 12.4
    copy = tuple(Word(f" {t}", 12.62, 12.62, 0.9) for t in "The reporting environment is also a quite".split())
    crammed = copy + (Word(" different.", 12.62, 12.78, 1.0),)
    speech = Utterance(0, speech_start_s=9.6, speech_end_s=12.9, audio=np.zeros(1, np.float32))
    assert texts(utterance_words(pass_of(said + crammed), speech, options)) == texts(said)
    # A word left out or changed inside the copy as well; the words after it in a pass going on stay.
    before = tuple(Word(w.text, w.start_s - 10, w.end_s - 10, 0.9) for w in said)
    for changed in ("reporting environment is also quite", "the reporting environment was also quite"):
        copy = tuple(Word(f" {t}", 2.0, 2.0, 0.9) for t in changed.split()) + (Word(" different.", 2.0, 2.1, 0.9),)
        assert said_again(before, copy + words("and more", start_s=2.2)) == len(copy), changed
    # The word added must be crammed in too: "and", said after the copy, is not whisper's.
    copy = tuple(Word(f" {t}", 2.0, 2.0, 0.9) for t in "reporting environment is also quite different.".split())
    assert said_again(before, copy + words("and more", start_s=2.2)) == len(copy)
    # A copy said as it is timed (a speaker repeating themself with a change) stays, as does a short copy
    # with a change: "so this is" after "so that is" at an instant can be what was said.
    timed = words("the reporting environment was also quite different.", start_s=12.9)
    assert texts(spoken_words(said + timed, replace(speech, speech_end_s=15.8), True)) == texts(said + timed)
    short = tuple(Word(f" {t}", 2.0, 2.0, 0.9) for t in "so this is".split())
    assert said_again(words("so that is", start_s=1.0), short + words("it", start_s=2.1)) == 0
