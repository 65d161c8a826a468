"""`specvox bench asr`: streaming recognition replayed in real time, on speech with known text.

Each test sentence is spoken by the bundled Piper voice and by espeak-ng (when installed),
with 1 s of silence before and 1.5 s after, and fed to `StreamingRecognizer` in 100 ms
chunks as a live microphone would deliver them. The replay keeps a simulated clock: a chunk
"arrives" when its last sample has been spoken; while the model thread is busy, the chunks
that arrive wait and are then fed in one go (as the asr service does). Each feed advances the
clock by the wall time it really took on this machine. So, per clip:

- `final_ms`: clock when the final was emitted − the VAD's end of speech (audio time);
- `preempt_ms`: the same for the first partial that the gateway would start a turn from
  (all words committed, silence begun) and whose text equals the final's (empty if none);
- `partial_gap_ms`: the largest gap between consecutive results (speech start, partials,
  final) while the user speaks; `partial_p50_ms`: their median;
- `rtf`: model-thread time / audio duration;
- `wer`: word error rate of the final transcripts against the sentence (normalised text).
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

from bench.turn import questions
from pipeline.asr import SAMPLE_RATE_HZ, AsrOptions, Transcriber
from pipeline.asr_stream import FinalTranscript, PartialTranscript, SpeechStarted, StreamingRecognizer, normalised_text
from pipeline.audio import pcm_to_mono_float, resample, split_wav_bytes

CHUNK_S = 0.1
LEAD_S, TRAIL_S = 1.0, 1.5


@dataclass
class Replay:
    """What one clip's replay produced, each event with its clock time in seconds."""

    events: list[tuple[float, object]] = field(default_factory=list)
    model_s: float = 0.0


def replay(recognizer: StreamingRecognizer, audio: np.ndarray) -> Replay:
    chunk = int(CHUNK_S * SAMPLE_RATE_HZ)
    out, clock_s, fed = Replay(), 0.0, 0
    while fed < audio.size:
        clock_s = max(clock_s, (fed + chunk) / SAMPLE_RATE_HZ)  # wait for the next chunk if idle
        arrived = min(audio.size, int(clock_s * SAMPLE_RATE_HZ) // chunk * chunk)
        clock_s = _timed(out, clock_s, recognizer.feed, audio[fed:arrived])
        fed = arrived
    _timed(out, clock_s, recognizer.finish)
    return out


def _timed(out: Replay, clock_s: float, fn, *args) -> float:
    t0 = time.perf_counter()
    events = fn(*args)
    spent = time.perf_counter() - t0
    out.model_s += spent
    out.events += [(clock_s + spent, e) for e in events]
    return clock_s + spent


def clip_row(voice: str, text: str, audio: np.ndarray, result: Replay) -> dict:
    finals = [(t, e) for t, e in result.events if isinstance(e, FinalTranscript)]
    hypothesis = " ".join(normalised_text(e.text) for _, e in finals)
    row: dict = {"voice": voice, "text": text, "transcript": hypothesis, "utterances": len(finals),
                 "words": len(normalised_text(text).split()),
                 "errors": _errors(normalised_text(text), hypothesis),
                 "rtf": round(result.model_s / (audio.size / SAMPLE_RATE_HZ), 3)}
    if not finals:
        return row | {"final_ms": None, "preempt_ms": None, "partial_gap_ms": None, "partial_p50_ms": None}
    final_t, final = finals[-1]
    speech_end_s = final.utterance.speech_end_s
    preempt = [t for t, e in result.events if isinstance(e, PartialTranscript) and e.speech_ending
               and not e.tentative and normalised_text(e.text) == normalised_text(final.text)]
    times = [t for t, e in result.events if isinstance(e, SpeechStarted | PartialTranscript)] + [final_t]
    gaps = [b - a for a, b in pairwise(times) if a <= speech_end_s]
    return row | {
        "final_ms": round((final_t - speech_end_s) * 1000),
        "preempt_ms": round((preempt[0] - speech_end_s) * 1000) if preempt else None,
        "partial_gap_ms": round(max(gaps) * 1000) if gaps else None,
        "partial_p50_ms": round(statistics.median(gaps) * 1000) if gaps else None,
        "final_reused_partial": final.reused_partial,
    }


def _errors(reference: str, hypothesis: str) -> int:
    import jiwer

    if not hypothesis:
        return len(reference.split())
    out = jiwer.process_words(reference, hypothesis)
    return out.substitutions + out.deletions + out.insertions


def voices(settings) -> dict:
    from pipeline.tts.piper_backend import PiperSynthesizer

    piper = PiperSynthesizer(settings.tts)
    made = {"piper": lambda text: piper.synthesize(text, SAMPLE_RATE_HZ)}
    if shutil.which("espeak-ng"):
        made["espeak-ng"] = espeak
    else:
        print("espeak-ng is not installed: only the Piper voice is measured")
    return made


def espeak(text: str) -> np.ndarray:
    wav = subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "--stdout", text],
                         check=True, capture_output=True).stdout
    pcm, fmt = split_wav_bytes(wav)
    return resample(pcm_to_mono_float(pcm, fmt), fmt.sample_rate_hz, SAMPLE_RATE_HZ)


def run(settings, sentences: int, json_path: str | None) -> int:
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # it logs every pass
    options: AsrOptions = settings.asr
    transcriber = Transcriber(options)
    transcriber.warm_up()
    rows = []
    for voice, speak in voices(settings).items():
        for text in questions(sentences):
            speech = speak(text)
            audio = np.concatenate([np.zeros(int(LEAD_S * SAMPLE_RATE_HZ), np.float32), speech,
                                    np.zeros(int(TRAIL_S * SAMPLE_RATE_HZ), np.float32)])
            rows.append(clip_row(voice, text, audio, replay(StreamingRecognizer(options, transcriber), audio)))
            print(f"  {len(rows)} clips", flush=True)
    summary = summarise(rows, options)
    print_table(rows, summary)
    if json_path:
        Path(json_path).write_text(json.dumps({"summary": summary, "clips": rows}, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def summarise(rows: list[dict], options: AsrOptions) -> dict:
    def pct(name: str, q: float) -> float | None:
        values = sorted(r[name] for r in rows if r.get(name) is not None)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else None

    summary: dict = {"end_of_speech_silence_ms": options.end_of_speech_silence_ms,
                     "partial_every_ms": options.partial_every_ms, "clips": len(rows),
                     "split_clips": sum(r["utterances"] > 1 for r in rows)}
    for name in ("final_ms", "preempt_ms", "partial_gap_ms", "partial_p50_ms", "rtf"):
        summary[f"{name}_p50"], summary[f"{name}_p95"] = pct(name, 0.5), pct(name, 0.95)
    summary["preempt_ready_clips"] = sum(r.get("preempt_ms") is not None for r in rows)
    for voice in sorted({r["voice"] for r in rows}):
        mine = [r for r in rows if r["voice"] == voice]
        summary[f"wer_{voice}"] = round(sum(r["errors"] for r in mine) / sum(r["words"] for r in mine), 3)
    return summary


def print_table(rows: list[dict], summary: dict) -> None:
    cols = ["utterances", "final_ms", "preempt_ms", "partial_p50_ms", "partial_gap_ms", "rtf"]
    print(f"\n{'voice':<10} {'sentence':<44} " + " ".join(f"{c:>14}" for c in cols) + "  transcript")
    for r in rows:
        cells = " ".join(f"{'-' if r.get(c) is None else r[c]:>14}" for c in cols)
        print(f"{r['voice']:<10} {r['text'][:43]:<44} {cells}  {r['transcript']}")
    print()
    for key, value in summary.items():
        print(f"{key:<28} {value}")
