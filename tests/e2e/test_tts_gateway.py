"""The reply's word cues through the whole stack: tts times them, the gateway forwards them, the client writes them."""

from __future__ import annotations

from itertools import pairwise

import pytest
import srt
import webvtt

from pipeline.asr_stream import normalised_text
from services.client import ClientOptions, converse, write_outputs
from tests.conftest import write_wav

pytestmark = pytest.mark.e2e


async def test_a_spoken_reply_comes_with_word_cues_inside_its_phrase_cues(stack, speech, tmp_path):
    wav = write_wav(tmp_path / "question.wav", speech("Why do cats purr?"), 16_000)
    turns = await converse(stack["gateway"], str(wav), ClientOptions(realtime=False))
    report = write_outputs(turns, str(tmp_path / "out"))
    turn = next(t for t in turns if t.report is report)
    assert report["reply_text"].strip()

    words = list(webvtt.read(str(tmp_path / "out" / "word_captions.vtt")))
    phrases = list(srt.parse((tmp_path / "out" / "captions.srt").read_text()))
    assert normalised_text(" ".join(w.text for w in words)) == normalised_text(report["reply_text"])
    assert normalised_text(" ".join(p.content for p in phrases)) == normalised_text(report["reply_text"])
    assert all(a.end_s <= b.start_s for a, b in pairwise(turn.word_cues))
    spans = [(p.start.total_seconds(), p.end.total_seconds()) for p in phrases]
    assert all(any(start - 1e-3 <= w.start_s <= w.end_s <= end + 1e-3 for start, end in spans)
               for w in turn.word_cues)
