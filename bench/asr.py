"""`specvox bench asr`: streaming recognition replayed in real time, on speech with known text.

Each test sentence is spoken by the bundled Piper voice (noise off, so every run hears the same
audio) and by espeak-ng (when installed), with 1 s of silence before and 1.5 s after, and fed to
`StreamingRecognizer` in 100 ms chunks (`--chunk-ms`; WebRTC sends 20 ms) as a live microphone
would deliver them. The replay keeps
a simulated clock: a chunk "arrives" when its last sample has been spoken; while the model
thread is busy, the chunks that arrive wait and are then fed in one go (as the asr service
does). Each feed advances the clock by the wall time it really took on this machine, or with
`--clock cpu` by the CPU time this process spent on it: on a machine shared with other work
that is close to what the feed would take alone, as long as the model uses one thread
(`asr.cpu_threads=1`, the default; CPU time adds up the time of parallel threads).

`--variant NAME:key=value,...` replays every clip again with those `asr.*` settings changed;
the variants of one clip run back to back, so a busy machine slows them alike and their ratios
can be compared. Per clip and variant:

- **end of speech** (`speech_end_s`): where the spoken audio really ends: the last 10 ms frame
  within 35 dB of the clip's loudest. `vad_end_s`: where Silero put it (what a FINAL carries);
- `final_ms`: clock when the final was emitted − end of speech; `final_vad_ms`: − the VAD's;
- `preempt_ms`: the same for the first partial that the gateway would start a turn from (all
  words committed, silence begun) and whose text equals the final's (empty if none);
- `partial_gap_ms`: the largest gap between consecutive results (speech start, partials,
  final) while the user speaks (a gap that starts before the end of speech);
  `partial_p50_ms`: their median;
- `rtf`: total ASR compute (model-thread wall time: VAD checks and every transcription pass)
  / the clip's audio duration (silences included); `rtf_speech`: / the spoken part only;
- `wer`: word error rate of the final transcripts against the sentence (normalised text).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise
from pathlib import Path

import numpy as np

from bench.turn import questions
from pipeline.asr import SAMPLE_RATE_HZ, AsrOptions, Transcriber
from pipeline.asr_stream import FinalTranscript, PartialTranscript, SpeechStarted, StreamingRecognizer, normalised_text
from pipeline.audio import pcm_to_mono_float, resample, split_wav_bytes

LEAD_S, TRAIL_S = 1.0, 1.5
SPEECH_FLOOR_DB = 35  # a 10 ms frame this far below the clip's loudest is silence


@dataclass
class Replay:
    """What one clip's replay produced, each event with its clock time in seconds."""

    events: list[tuple[float, object]] = field(default_factory=list)
    model_s: float = 0.0


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def replay(recognizer: StreamingRecognizer, audio: np.ndarray, chunk_ms: int = 100, clock: str = "wall") -> Replay:
    chunk = chunk_ms * SAMPLE_RATE_HZ // 1000
    out, clock_s, fed = Replay(), 0.0, 0
    while fed < audio.size:
        clock_s = max(clock_s, (fed + chunk) / SAMPLE_RATE_HZ)  # wait for the next chunk if idle
        arrived = min(audio.size, int(clock_s * SAMPLE_RATE_HZ) // chunk * chunk)
        clock_s = _timed(out, clock_s, CLOCKS[clock], recognizer.feed, audio[fed:arrived])
        fed = arrived
    _timed(out, clock_s, CLOCKS[clock], recognizer.finish)
    return out


def _timed(out: Replay, clock_s: float, now, fn, *args) -> float:
    t0 = now()
    events = fn(*args)
    spent = now() - t0
    out.model_s += spent
    out.events += [(clock_s + spent, e) for e in events]
    return clock_s + spent


def spoken_span_s(speech: np.ndarray) -> tuple[float, float]:
    """Where speech really starts and ends in a clip: 10 ms frames within SPEECH_FLOOR_DB of the loudest."""
    frame = SAMPLE_RATE_HZ // 100
    frames = speech[: speech.size // frame * frame].reshape(-1, frame)
    rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    loud = np.flatnonzero(rms >= rms.max() * 10 ** (-SPEECH_FLOOR_DB / 20))
    return loud[0] / 100, (loud[-1] + 1) / 100


def clip_row(voice: str, text: str, audio: np.ndarray, spoken_s: tuple[float, float], result: Replay) -> dict:
    finals = [(t, e) for t, e in result.events if isinstance(e, FinalTranscript)]
    hypothesis = " ".join(normalised_text(e.text) for _, e in finals)
    speech_start_s, speech_end_s = spoken_s
    row: dict = {"voice": voice, "text": text, "transcript": hypothesis, "utterances": len(finals),
                 "words": len(normalised_text(text).split()),
                 "errors": _errors(normalised_text(text), hypothesis),
                 "speech_end_s": speech_end_s, "model_s": round(result.model_s, 3),
                 "audio_s": audio.size / SAMPLE_RATE_HZ,
                 "rtf": round(result.model_s / (audio.size / SAMPLE_RATE_HZ), 3),
                 "rtf_speech": round(result.model_s / (speech_end_s - speech_start_s), 3)}
    if not finals:
        return row | {k: None for k in ("final_ms", "final_vad_ms", "preempt_ms", "partial_gap_ms", "partial_p50_ms")}
    final_t, final = finals[-1]
    vad_end_s = final.utterance.speech_end_s
    preempt = [t for t, e in result.events if isinstance(e, PartialTranscript) and e.speech_ending
               and normalised_text(e.text) == normalised_text(final.text)]
    times = [t for t, e in result.events if isinstance(e, SpeechStarted | PartialTranscript)] + [final_t]
    gaps = [b - a for a, b in pairwise(times) if a <= speech_end_s]
    return row | {
        "vad_end_s": vad_end_s,
        "final_ms": round((final_t - speech_end_s) * 1000),
        "final_vad_ms": round((final_t - vad_end_s) * 1000),
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

    piper = PiperSynthesizer(replace(settings.tts, noise_scale=0.0, noise_w_scale=0.0))
    made = {"piper": lambda text: piper.synthesize(text, SAMPLE_RATE_HZ)}
    if shutil.which("espeak-ng"):
        made["espeak-ng"] = espeak
    else:
        print("espeak-ng is not installed: only the Piper voice is measured")
    return made


def espeak(text: str, voice: str = "en-us") -> np.ndarray:
    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "--stdout", text],
                         check=True, capture_output=True).stdout
    pcm, fmt = split_wav_bytes(wav)
    return resample(pcm_to_mono_float(pcm, fmt), fmt.sample_rate_hz, SAMPLE_RATE_HZ)


def parse_variant(spec: str, base: AsrOptions) -> tuple[str, AsrOptions]:
    """"name:key=value,key=value" -> (name, base with those asr settings changed)."""
    name, _, assignments = spec.partition(":")
    types = {f.name: f.type for f in fields(AsrOptions)}
    changes: dict = {}
    for assignment in filter(None, assignments.split(",")):
        key, _, value = assignment.partition("=")
        if key not in types:
            raise SystemExit(f"--variant {spec!r}: no asr setting {key!r}")
        kind = types[key]
        changes[key] = (value.lower() in ("1", "true", "yes") if kind == "bool" else
                        int(value) if kind == "int" else float(value) if kind == "float" else value)
    return name, replace(base, **changes)


def run(settings, sentences: int, json_path: str | None, variants: list[str] | None = None,
        chunk_ms: int = 100, clock: str = "wall") -> int:
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # it logs every pass
    configs = [("default", settings.asr)] + [parse_variant(v, settings.asr) for v in variants or []]
    transcribers: dict = {}  # one model per distinct set of model settings
    for _, options in configs:
        if _model_key(options) not in transcribers:
            transcribers[_model_key(options)] = Transcriber(options)
            transcribers[_model_key(options)].warm_up()
    rows = []
    for voice, speak in voices(settings).items():
        for text in questions(sentences):
            speech = speak(text)
            start_s, end_s = spoken_span_s(speech)
            audio = np.concatenate([np.zeros(int(LEAD_S * SAMPLE_RATE_HZ), np.float32), speech,
                                    np.zeros(int(TRAIL_S * SAMPLE_RATE_HZ), np.float32)])
            for name, options in configs:
                result = replay(StreamingRecognizer(options, transcribers[_model_key(options)]), audio, chunk_ms, clock)
                rows.append({"variant": name} | clip_row(voice, text, audio, (LEAD_S + start_s, LEAD_S + end_s),
                                                         result))
            print(f"  {len(rows) // len(configs)} clips", flush=True)
    summaries = {name: summarise([r for r in rows if r["variant"] == name], options) for name, options in configs}
    for name, _ in configs:
        print(f"\n== {name}")
        print_table([r for r in rows if r["variant"] == name], summaries[name])
    print_comparison(summaries)
    if json_path:
        Path(json_path).write_text(json.dumps({"summary": summaries, "chunk_ms": chunk_ms, "clock": clock,
                                               "clips": rows}, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def _model_key(options: AsrOptions) -> tuple:
    """The settings a Transcriber is built from: variants that share them share a model."""
    return (options.model, options.device, options.compute_type, options.cpu_threads,
            options.trim_encoder_input, options.encoder_min_s, options.offline)


def summarise(rows: list[dict], options: AsrOptions) -> dict:
    def pct(name: str, q: float) -> float | None:
        values = [r[name] for r in rows if r.get(name) is not None]
        return np.percentile(values, q * 100, method="nearest").item() if values else None

    summary: dict = {"options": {f.name: getattr(options, f.name) for f in fields(options)}, "clips": len(rows),
                     "split_clips": sum(r["utterances"] > 1 for r in rows)}
    for name in ("final_ms", "final_vad_ms", "preempt_ms", "partial_gap_ms", "partial_p50_ms", "rtf", "rtf_speech"):
        summary[f"{name}_p50"], summary[f"{name}_p95"] = pct(name, 0.5), pct(name, 0.95)
    summary["rtf_all"] = round(sum(r["model_s"] for r in rows) / sum(r["audio_s"] for r in rows), 3)
    summary["preempt_ready_clips"] = sum(r.get("preempt_ms") is not None for r in rows)
    for voice in sorted({r["voice"] for r in rows}):
        mine = [r for r in rows if r["voice"] == voice]
        summary[f"wer_{voice}"] = round(sum(r["errors"] for r in mine) / sum(r["words"] for r in mine), 3)
    return summary


def print_table(rows: list[dict], summary: dict) -> None:
    cols = ["utterances", "final_ms", "final_vad_ms", "preempt_ms", "partial_p50_ms", "partial_gap_ms", "rtf"]
    print(f"\n{'voice':<10} {'sentence':<44} " + " ".join(f"{c:>14}" for c in cols) + "  transcript")
    for r in rows:
        cells = " ".join(f"{'-' if r.get(c) is None else r[c]:>14}" for c in cols)
        print(f"{r['voice']:<10} {r['text'][:43]:<44} {cells}  {r['transcript']}")
    print()
    for key, value in summary.items():
        if key != "options":
            print(f"{key:<28} {value}")


def print_comparison(summaries: dict[str, dict]) -> None:
    """One line per variant: the issue's goals side by side."""
    print("\n| variant | final p50 / p95 (ms) | final after VAD end p50 | preemption point p50, clips "
          "| partial gap median / worst p50 / worst p95 (ms) | RTF all / p50 / speech p50 | WER Piper | WER espeak-ng "
          "| split clips |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in summaries.items():
        print(f"| {name} | {s['final_ms_p50']} / {s['final_ms_p95']} | {s['final_vad_ms_p50']} "
              f"| {s['preempt_ms_p50']}, {s['preempt_ready_clips']} of {s['clips']} "
              f"| {s['partial_p50_ms_p50']} / {s['partial_gap_ms_p50']} / {s['partial_gap_ms_p95']} "
              f"| {s['rtf_all']} / {s['rtf_p50']} / {s['rtf_speech_p50']} | {s.get('wer_piper')} "
              f"| {s.get('wer_espeak-ng', '-')} | {s['split_clips']} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=8, help="sentences per voice")
    add_replay_arguments(parser, "docs/benchmarks/results/asr.json")


def add_replay_arguments(parser: argparse.ArgumentParser, json_path: str) -> None:
    """The options of a benchmark that replays clips to the recognizer (this one, bench asr-finals)."""
    parser.add_argument("--json", dest="json_path", default=json_path,
                        help="write the rows here (default: %(default)s, the current figures)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="also replay each clip with these asr settings changed (repeatable), "
                             "e.g. base:model=base")
    parser.add_argument("--chunk-ms", type=int, default=100, help="audio per chunk the replayed microphone sends")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time a feed by wall time, or by this process's CPU time (a busy machine)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.turns, args.json_path, args.variant, args.chunk_ms, args.clock)
