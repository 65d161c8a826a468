"""bench.asr_finals's yardstick: the stretches of speech its offline pass is rerun on, and the inaudible changes."""

from __future__ import annotations

import numpy as np

from bench.asr_finals import INAUDIBLE, MAX_STRETCH_S, speech_stretches
from pipeline.asr import SAMPLE_RATE_HZ, Utterance
from pipeline.asr_stream import FinalTranscript


def final(start_s: float, end_s: float) -> FinalTranscript:
    return FinalTranscript(Utterance(0, start_s, end_s, np.zeros(16, np.float32)), (), reused_partial=False)


def test_utterances_closer_than_the_pause_make_one_stretch_and_a_longer_pause_starts_another() -> None:
    finals = [final(0.5, 1.0), final(1.4, 3.0), final(4.99, 5.5), final(7.5, 8.0)]
    assert speech_stretches(finals, pause_s=2.0) == [(0.5, 5.5), (7.5, 8.0)]
    assert speech_stretches(finals, pause_s=0.3) == [(0.5, 1.0), (1.4, 3.0), (4.99, 5.5), (7.5, 8.0)]


def test_a_stretch_is_cut_before_it_outgrows_one_whisper_window() -> None:
    finals = [final(float(s), s + 0.8) for s in range(0, 40)]  # speech every second, 0.2 s pauses
    stretches = speech_stretches(finals, pause_s=2.0)
    assert len(stretches) == 2
    assert all(end - start <= MAX_STRETCH_S for start, end in stretches)
    assert stretches[0][0] == 0.0 and stretches[-1][1] == 39.8
    assert speech_stretches([], 2.0) == []


def test_the_inaudible_changes_move_the_start_by_a_fraction_of_a_second_or_the_level_by_2_db() -> None:
    audio = np.full(SAMPLE_RATE_HZ, 0.5, np.float32)
    lengths = {name: change(audio).size - audio.size for name, change in INAUDIBLE.items()}
    assert lengths == {"0.1 s less silence before": -1600, "0.2 s more silence before": 3200, "2 dB quieter": 0}
    quieter = INAUDIBLE["2 dB quieter"](audio)
    assert quieter.dtype == np.float32
    assert abs(20 * np.log10(quieter.max() / audio.max()) + 2) < 1e-4
