"""`specvox bench asr-finals`: are streamed finals as good as offline words, and do sounds stay no words?

Three measures, each on the same clips for every `--variant` (`--variant base:model=base` adds the
multilingual whisper base):

- **streaming WER − offline WER**: each clip is replayed in real time through `StreamingRecognizer`
  (`bench.asr.replay`: chunks arrive as spoken, and wait while the model thread is busy, as in the
  asr service), and its finals' words are scored against the reference; the same model then
  transcribes the whole clip at once with faster-whisper's own `transcribe` (greedy as the stream,
  30 s windows, its temperature fallback), scored the same way. Goal: the difference ≤ 0.01.
  Clips: real human speech (`bench.human_speech`: nine recordings that public packages ship with
  timed references) and questions with a pause inside ("Hello, … can you tell me …") said by the
  bundled Piper voice and three espeak-ng voices;
- **the yardstick's own spread**: the offline WER, and the streamed, once more with each clip
  changed in ways no listener would notice (`INAUDIBLE`: 0.1 s less or 0.2 s more silence before
  the speech, 2 dB quieter), and their difference over the four versions of each clip; and the
  offline WER with the offline pass run on each stretch of the stream's speech between pauses of
  at least `STRETCH_PAUSE_S` (with `STRETCH_PAD_S` of the clip's audio either side) instead of on
  the whole clip: what a recognizer that commits words at pauses scores even when its passes are
  the offline pass itself. A difference between streamed and offline smaller than these moves is
  not one this set can resolve;
- **finals equal to their own pass**: each final's words against `utterance_words` of a pass
  over its utterance's audio (after the speech before it it goes on from, `FinalTranscript.before`;
  goal: all, word for word), how many finals went on from speech before them, and how many reused
  the pass at the first silence (no pass of their own);
- **non-words**: short non-lexical sounds (hums and "mm-hmm" said by the voices, synthetic
  hums) streamed alone, with no prompt and with the backchannel prompt the gateway sends while a
  reply is paused: how many finals have words (goal 0); and short real words ("Stop.", "Yes."),
  how many finals kept them (goal all).

Also each variant's model memory (the process's resident memory added by loading it), RTF, and how long after
the VAD's end of speech each final came out (on the replay's clock), apart for finals heard alone and after speech.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.asr import _model_key, add_replay_arguments, espeak, parse_variant, replay
from bench.e2e import PAUSED, percentiles, trim
from pipeline.asr import SAMPLE_RATE_HZ, AsrOptions, Transcriber, prompt_of_phrases
from pipeline.asr_stream import FinalTranscript, StreamingRecognizer
from pipeline.asr_words import utterance_words
from pipeline.turn_taking import DEFAULT_BACKCHANNELS

ESPEAK_VOICES = ("en-us", "en-gb+f3", "en-us+m3")
PAUSES_MS = (600, 450, 500, 400)  # one per PAUSED sentence, as bench/e2e draws them (400-600 ms)
QUESTIONS = ("Tell me about a friendly robot dog.", "What is the tallest mountain in the world?",
             "My favourite colour is blue, and I like to swim in the sea.")
NON_WORDS = ("Mm-hmm.", "Mhm.", "Mmm.", "Hmm.")
SHORT_WORDS = ("Stop.", "Yes.", "No.", "Wait.", "Hold on.", "Okay.")
# Changes to a clip no listener would notice, under which the offline WER is measured again.
INAUDIBLE = {
    "0.1 s less silence before": lambda audio: audio[SAMPLE_RATE_HZ // 10:],
    "0.2 s more silence before": lambda audio: np.concatenate([_silence(200), audio]),
    "2 dB quieter": lambda audio: (audio * 10 ** (-2 / 20)).astype(np.float32),
}
STRETCH_PAUSE_S = 2.0  # a pause at least this long ends a stretch of speech for the offline pass
MAX_STRETCH_S = 28.0  # a stretch longer than this is cut, so one offline window (30 s) holds it whole
STRETCH_PAD_S = 0.3  # the clip's audio taken either side of a stretch's speech (asr.transcribe_pad_ms)


@dataclass(frozen=True)
class Clip:
    name: str
    kind: str  # "human" or "synthetic"
    reference: str
    audio: np.ndarray


def synthetic_clips(settings) -> list[Clip]:
    """The PAUSED sentences with their pause, and QUESTIONS, in each voice; 0.5 s before, 1 s after."""
    clips = []
    for voice, speak in speakers(settings).items():
        for (first, second), pause_ms in zip(PAUSED, PAUSES_MS, strict=True):
            audio = [speak(first), _silence(pause_ms), speak(second)]
            clips.append(Clip(f"{voice}: {first} … {second}", "synthetic", f"{first} {second}", _padded(audio)))
        clips += [Clip(f"{voice}: {q}", "synthetic", q, _padded([speak(q)])) for q in QUESTIONS]
    return clips


def human_clips() -> list[Clip]:
    from bench.human_speech import load_clips

    return [Clip(c.name, "human", c.reference_text, c.audio) for c in load_clips()]


def speakers(settings) -> dict:
    """Piper (the bundled voice, noise off) and the espeak-ng voices: text -> trimmed 16 kHz speech."""
    from pipeline.tts.piper_backend import PiperSynthesizer

    piper = PiperSynthesizer(replace(settings.tts, noise_scale=0.0, noise_w_scale=0.0))
    made = {"piper": lambda text: trim(piper.synthesize(text, SAMPLE_RATE_HZ))}
    if shutil.which("espeak-ng"):
        made |= {v: (lambda text, v=v: trim(espeak(text, v))) for v in ESPEAK_VOICES}
    return made


def hum(f0_hz: tuple[float, ...], durations_s: tuple[float, ...], gap_s: float = 0.12) -> np.ndarray:
    """A hummed "mm-hmm": a harmonic tone per syllable, gliding in pitch, with soft edges; no words in it."""
    parts: list[np.ndarray] = []
    for f0, d in zip(f0_hz, durations_s, strict=True):
        t = np.arange(int(d * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
        phase = 2 * np.pi * np.cumsum(np.linspace(f0, f0 * 1.1, t.size)) / SAMPLE_RATE_HZ
        tone = sum(np.sin(k * phase) / k**1.5 for k in range(1, 12))
        envelope = np.minimum(1.0, np.minimum(t / 0.03, (d - t) / 0.05))
        parts += [0.15 * tone * envelope, np.zeros(int(gap_s * SAMPLE_RATE_HZ))]
    return np.concatenate(parts[:-1]).astype(np.float32)


def short_sounds(settings) -> list[Clip]:
    """Non-words (reference "") and short real words, each alone with 0.5 s before and 1 s after."""
    clips = []
    for voice, speak in speakers(settings).items():
        clips += [Clip(f"{voice}: {t}", "non-word", "", _padded([speak(t)])) for t in NON_WORDS]
        clips += [Clip(f"{voice}: {t}", "word", t, _padded([speak(t)])) for t in SHORT_WORDS]
    for f0, durations in (((120, 150), (0.25, 0.35)), ((95, 105), (0.3, 0.4)), ((200, 240), (0.3, 0.3))):
        clips.append(Clip(f"hum {f0} Hz", "non-word", "", _padded([hum(f0, durations)])))
    return clips


def run(settings, json_path: str | None, variants: list[str], chunk_ms: int, clock: str,
        human: bool = True) -> int:
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)
    configs = [("default", settings.asr)] + [parse_variant(v, settings.asr) for v in variants]
    models: dict = {}
    for _, options in configs:
        if _model_key(options) not in models:
            models[_model_key(options)] = _load(options)
    clips = (human_clips() if human else []) + synthetic_clips(settings)
    sounds = short_sounds(settings)
    report: dict = {"chunk_ms": chunk_ms, "clock": clock, "variants": {}}
    for name, options in configs:
        transcriber, offline, memory_mb = models[_model_key(options)]
        rows = [_clip_row(clip, options, transcriber, offline, chunk_ms, clock) for clip in clips]
        sound_rows = [_sound_row(clip, options, transcriber, prompt) for clip in sounds
                      for prompt in ("", prompt_of_phrases(DEFAULT_BACKCHANNELS))]
        report["variants"][name] = {"summary": summarise(rows, sound_rows) | {"model_memory_mb": memory_mb},
                                    "clips": rows, "short_sounds": sound_rows}
        print_variant(name, rows, sound_rows, report["variants"][name]["summary"])
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def _load(options: AsrOptions) -> tuple[Transcriber, object, float]:
    """The streaming transcriber, a stock faster-whisper model for the offline pass, and the resident
    memory (MB) loading both added (the stock one shares nothing with the first)."""
    from faster_whisper import WhisperModel

    from pipeline.models import resolve_asr

    before = _rss_mb()
    transcriber = Transcriber(options)
    transcriber.warm_up()
    memory_mb = _rss_mb() - before
    offline = WhisperModel(resolve_asr(options.model), device=options.device, compute_type=options.compute_type,
                           cpu_threads=options.cpu_threads, local_files_only=options.offline)
    return transcriber, offline, round(memory_mb)


def _clip_row(clip: Clip, options: AsrOptions, transcriber: Transcriber, offline, chunk_ms: int,
              clock: str) -> dict:
    from bench.human_speech import word_errors

    result = replay(StreamingRecognizer(options, transcriber), clip.audio, chunk_ms, clock)
    timed = [(t, e) for t, e in result.events if isinstance(e, FinalTranscript)]
    finals = [e for _, e in timed]
    final_ms = [(round((t - e.utterance.speech_end_s) * 1000), e.before is not None) for t, e in timed]
    streamed = " ".join(f.text for f in finals)
    own = [utterance_words(transcriber.transcribe(f.utterance, before=f.before), f.utterance, options) for f in finals]
    different = [(f.text, " ".join(w.text.strip() for w in o)) for f, o in zip(finals, own, strict=True)
                 if [w.text for w in f.words] != [w.text for w in o]]
    t0 = time.process_time()
    whole = _offline_text(offline, clip.audio, options)
    offline_s = time.process_time() - t0
    stream_errors, words = word_errors(clip.reference, streamed)
    offline_errors, _ = word_errors(clip.reference, whole)
    inaudible, inaudible_streamed = {}, {}
    for name, change in INAUDIBLE.items():
        changed = change(clip.audio)
        inaudible[name] = word_errors(clip.reference, _offline_text(offline, changed, options))[0]
        inaudible_streamed[name] = word_errors(clip.reference, _streamed_text(changed, options, transcriber,
                                                                              chunk_ms, clock))[0]
    stretches = [clip.audio[_samples(start_s - STRETCH_PAD_S):_samples(end_s + STRETCH_PAD_S)]
                 for start_s, end_s in speech_stretches(finals, STRETCH_PAUSE_S)]
    at_pauses = " ".join(_offline_text(offline, audio, options) for audio in stretches)
    audio_s = clip.audio.size / SAMPLE_RATE_HZ
    return {"clip": clip.name, "kind": clip.kind, "words": words, "stream_errors": stream_errors,
            "offline_errors": offline_errors, "offline_inaudible_errors": inaudible,
            "stream_inaudible_errors": inaudible_streamed,
            "offline_at_pauses_errors": word_errors(clip.reference, at_pauses)[0], "finals": len(finals),
            "finals_own_pass_differ": different,
            "finals_reused_pass": sum(f.reused_partial for f in finals),
            "finals_after_speech": sum(f.before is not None for f in finals), "final_ms": final_ms,
            "stream_rtf": round(result.model_s / audio_s, 3), "offline_rtf": round(offline_s / audio_s, 3),
            "audio_s": round(audio_s, 2),
            "streamed": streamed, "offline": whole, "offline_at_pauses": at_pauses}


def _streamed_text(audio: np.ndarray, options: AsrOptions, transcriber: Transcriber, chunk_ms: int, clock: str) -> str:
    """The finals' words of `audio` replayed through a `StreamingRecognizer`."""
    result = replay(StreamingRecognizer(options, transcriber), audio, chunk_ms, clock)
    return " ".join(e.text for _, e in result.events if isinstance(e, FinalTranscript))


def _offline_text(offline, audio: np.ndarray, options: AsrOptions) -> str:
    """faster-whisper's own `transcribe` of `audio` (greedy as the stream, its 30 s windows and fallback)."""
    segments, _ = offline.transcribe(audio, language=options.language or None, beam_size=options.beam_size)
    return " ".join(s.text.strip() for s in segments)


def speech_stretches(finals: list[FinalTranscript], pause_s: float) -> list[tuple[float, float]]:
    """The finals' speech as (start, end) stretches: utterances less than `pause_s` apart joined,
    each stretch at most `MAX_STRETCH_S` long (whisper's window, less its padding)."""
    stretches: list[tuple[float, float]] = []
    for f in finals:
        start_s, end_s = f.utterance.speech_start_s, f.utterance.speech_end_s
        if stretches and start_s - stretches[-1][1] < pause_s and end_s - stretches[-1][0] <= MAX_STRETCH_S:
            stretches[-1] = (stretches[-1][0], end_s)
        else:
            stretches.append((start_s, end_s))
    return stretches


def _samples(seconds: float) -> int:
    return max(0, round(seconds * SAMPLE_RATE_HZ))


def _sound_row(clip: Clip, options: AsrOptions, transcriber: Transcriber, prompt: str) -> dict:
    recognizer = StreamingRecognizer(options, transcriber)
    recognizer.expected = prompt
    finals = [e for _, e in replay(recognizer, clip.audio, 20).events if isinstance(e, FinalTranscript)]
    return {"clip": clip.name, "kind": clip.kind, "prompted": bool(prompt), "utterances": len(finals),
            "words": " | ".join(f.text for f in finals if f.words)}


def summarise(rows: list[dict], sound_rows: list[dict]) -> dict:
    summary: dict = {}
    for kind in ("human", "synthetic", "all"):
        mine = [r for r in rows if kind in ("all", r["kind"])]
        if not mine:
            continue
        words = sum(r["words"] for r in mine)
        stream, offline = sum(r["stream_errors"] for r in mine) / words, sum(r["offline_errors"] for r in mine) / words
        inaudible = {name: round(sum(r["offline_inaudible_errors"][name] for r in mine) / words, 4)
                     for name in INAUDIBLE}
        streamed = {name: round(sum(r["stream_inaudible_errors"][name] for r in mine) / words, 4)
                    for name in INAUDIBLE}
        offline_wers = [offline, *inaudible.values()]
        stream_wers = [stream, *streamed.values()]
        stream_mean, offline_mean = sum(stream_wers) / len(stream_wers), sum(offline_wers) / len(offline_wers)
        at_pauses = sum(r["offline_at_pauses_errors"] for r in mine) / words
        summary[kind] = {"clips": len(mine), "words": words, "wer_stream": round(stream, 4),
                         "wer_offline": round(offline, 4), "wer_stream_minus_offline": round(stream - offline, 4),
                         "wer_offline_inaudible": inaudible, "wer_stream_inaudible": streamed,
                         "wer_stream_minus_offline_mean_of_4": round(stream_mean - offline_mean, 4),
                         "offline_spread": round(max(offline_wers) - min(offline_wers), 4),
                         "wer_offline_at_pauses": round(at_pauses, 4),
                         "offline_at_pauses_minus_offline": round(at_pauses - offline, 4),
                         "stream_rtf": round(sum(r["stream_rtf"] * r["audio_s"] for r in mine)
                                             / sum(r["audio_s"] for r in mine), 3),
                         "offline_rtf": round(sum(r["offline_rtf"] * r["audio_s"] for r in mine)
                                              / sum(r["audio_s"] for r in mine), 3)}
    summary["finals"] = sum(r["finals"] for r in rows)
    summary["finals_equal_own_pass"] = summary["finals"] - sum(len(r["finals_own_pass_differ"]) for r in rows)
    summary["finals_reused_pass"] = sum(r["finals_reused_pass"] for r in rows)
    summary["finals_after_speech"] = sum(r["finals_after_speech"] for r in rows)
    for after, key in ((False, "alone"), (True, "after_speech")):
        # the clock's time each final came out after the VAD's end of speech
        delays = percentiles([ms for r in rows for ms, a in r["final_ms"] if a == after])
        if delays["n"]:
            summary[f"final_ms_p50_p95_{key}"] = [delays["p50"], delays["p95"]]
    for prompted in (False, True):
        key = "prompted" if prompted else "unprompted"
        non = [r for r in sound_rows if r["kind"] == "non-word" and r["prompted"] == prompted]
        real = [r for r in sound_rows if r["kind"] == "word" and r["prompted"] == prompted]
        summary[f"non_words_with_words_{key}"] = f"{sum(bool(r['words']) for r in non)} of {len(non)}"
        summary[f"short_words_kept_{key}"] = f"{sum(bool(r['words']) for r in real)} of {len(real)}"
    return summary


def print_variant(name: str, rows: list[dict], sound_rows: list[dict], summary: dict) -> None:
    print(f"\n== {name}\n{'clip':<58} {'words':>5} {'stream err':>10} {'offline err':>11} {'finals':>6}  streamed")
    for r in rows:
        print(f"{r['clip'][:57]:<58} {r['words']:>5} {r['stream_errors']:>10} {r['offline_errors']:>11} "
              f"{r['finals']:>6}  {r['streamed'][:70]}")
        for streamed, own in r["finals_own_pass_differ"]:
            print(f"{'':>58} final {streamed!r} != own pass {own!r}")
    print("\nnon-words and short words (prompted: the gateway's backchannel prompt):")
    for r in sound_rows:
        print(f"  {r['kind']:<9} {r['clip'][:30]:<30} {'P' if r['prompted'] else '-'} {r['words']!r}")
    print()
    for key, value in summary.items():
        print(f"{key:<34} {value}")


def _rss_mb() -> float:
    """This process's resident memory (VmRSS), MB."""
    with open(f"/proc/{os.getpid()}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def _silence(ms: int) -> np.ndarray:
    return np.zeros(SAMPLE_RATE_HZ * ms // 1000, np.float32)


def _padded(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([_silence(500), *(p.astype(np.float32) for p in parts), _silence(1000)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_replay_arguments(parser, "docs/benchmarks/results/asr_finals.json")
    parser.add_argument("--no-human", action="store_true", help="synthesized speech only (no recordings to fetch)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.json_path, args.variant, args.chunk_ms, args.clock, human=not args.no_human)
