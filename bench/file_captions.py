"""`specvox bench file-captions`: how fast `specvox captions` turns a file into captions, and in how much memory.

A file of the bundled voice's speech (sentences 0.4-1.2 s apart, repeated to `--minutes`) is captioned in
this process with the identity cleaner (each caption its transcript: the lead's LLM cleaner is measured by
`specvox bench captions`), once per whisper thread count and batch size. Per run: the whole pipeline's wall
time and times real time; whisper alone (its passes, `asr_s`); decoding and the VAD (on a thread of their
own, beside whisper); the process's CPU time (times real time per CPU second: the work, whatever else the
machine runs); and the captions' word error rate against the sentences. Then `specvox captions` itself, as a
process with the identity cleaner, on the first minute and on the whole file: its peak RSS, flat if memory is
bounded (`--with-llm`: and on the first minute with the LLM cleaner, which adds its model).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

SENTENCES = (
    "Good morning, and welcome to the weekly planning meeting.",
    "Today we will look at the budget for the next quarter.",
    "I think that is a reasonable amount for the campaign.",
    "Can you tell me when the new office will open?",
    "The builders said it should be ready by the end of March.",
    "We also need to hire more engineers this year.",
    "Please send me the report before Friday afternoon.",
    "The weather was terrible on the way here this morning.",
    "Let us move on to the next item on the agenda.",
    "Our customers are happy with the latest release.",
    "There were a few complaints about the mobile app.",
    "The support team fixed most of them within a day.",
    "Thank you all for coming, and see you next week.",
)
RATE = 16_000


def make_speech(settings, minutes: float, path: Path) -> str:
    """A WAV of the sentences, in order and again, 0.4-1.2 s apart (seeded); the text said."""
    from pipeline.audio import float_to_pcm16, wav_bytes
    from pipeline.tts.synthesizers import load_synthesizer

    synthesizer = load_synthesizer(replace(settings.tts, noise_scale=0.0, noise_w_scale=0.0))
    clips = [synthesizer.synthesize(s, RATE) for s in SENTENCES]
    gaps = np.random.default_rng(0)
    parts, said, samples, i = [np.zeros(RATE // 2, np.float32)], [], RATE // 2, 0
    while samples < minutes * 60 * RATE:
        gap = np.zeros(int(gaps.uniform(0.4, 1.2) * RATE), np.float32)
        parts += [clips[i % len(clips)], gap]
        said.append(SENTENCES[i % len(clips)])
        samples += clips[i % len(clips)].size + gap.size
        i += 1
    path.write_bytes(wav_bytes(float_to_pcm16(np.concatenate(parts)), RATE))
    return " ".join(said)


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def caption_run(settings, path: Path, said: str, threads: int, batch: int) -> dict:
    import jiwer

    from pipeline.file_captions import FileCaptioner, FileCaptionOptions
    from pipeline.media import MediaAudio

    captioner = FileCaptioner(settings.asr, FileCaptionOptions(batch_utterances=batch, whisper_threads=threads))
    captioner.transcriber.warm_up()
    load_before = os.getloadavg()[0]
    with MediaAudio(path) as media:
        result = captioner.caption(media)
    t = result.timings
    audio_s = result.duration_s
    return {
        "threads": threads, "batch": batch, "audio_s": round(audio_s, 1), "utterances": len(result.utterances),
        "x_real_time": round(audio_s / t.total_s, 1), "asr_x_real_time": round(audio_s / t.asr_s, 1),
        "x_real_time_per_cpu_s": round(audio_s / t.cpu_s, 1),
        "wer": round(jiwer.wer(_words(said), _words(" ".join(u.caption for u in result.utterances))), 4),
        "timings_s": {k: round(v, 2) for k, v in asdict(t).items()},
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def command_peak_rss_mb(path: Path, out: Path, cleaner: str) -> tuple[float, float]:
    """`specvox captions PATH --cleaner CLEANER` as its own process: its peak RSS (MiB) and its wall time (s).

    The peak is the process's own high-water mark (VmHWM in /proc/PID/status), read every 20 ms until it exits:
    getrusage's children's maxrss would not do, as a child spawned from this process keeps this process's
    mark across its exec."""
    import time

    started = time.perf_counter()
    command = [sys.executable, "-m", "services.cli", "captions", str(path), "--out", str(out), "--quiet",
               "--cleaner", cleaner]
    process = subprocess.Popen(command)
    peak_kib = 0
    while process.poll() is None:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
            peak_kib = max(peak_kib, int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)))  # type: ignore[union-attr]
        except (OSError, AttributeError):
            pass  # exiting
        time.sleep(0.02)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return peak_kib / 1024, time.perf_counter() - started


def run(settings, minutes: float, threads: list[int], batches: list[int], with_llm: bool,
        json_path: str | None) -> int:
    from pipeline.audio import float_to_pcm16, wav_bytes
    from pipeline.media import decode_file

    work = Path(tempfile.mkdtemp(prefix="specvox-bench-"))
    path = work / "speech.wav"
    said = make_speech(settings, minutes, path)
    first_minute = work / "first_minute.wav"
    first_minute.write_bytes(wav_bytes(float_to_pcm16(decode_file(path)[: 60 * RATE]), RATE))
    rows = []
    for n in threads:
        for batch in batches:
            rows.append(caption_run(settings, path, said, n, batch))
            print_row(rows[-1], header=len(rows) == 1)
    memory = []
    for file, cleaner in [(first_minute, "identity"), (path, "identity")] + [(first_minute, "llm")] * with_llm:
        peak_mb, wall_s = command_peak_rss_mb(file, work / "out.vtt", cleaner)
        memory.append({"file": file.name, "cleaner": cleaner, "audio_s": round(decode_file(file).size / RATE, 1),
                       "peak_rss_mib": round(peak_mb), "wall_s": round(wall_s, 1)})
        print(f"specvox captions {file.name} --cleaner {cleaner}: {memory[-1]['audio_s']} s of audio, peak RSS "
              f"{peak_mb:.0f} MiB, {wall_s:.1f} s (models' loading included)", flush=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"runs": rows, "command_memory": memory}, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def print_row(row: dict, header: bool) -> None:
    cols = ("threads", "batch", "utterances", "x_real_time", "asr_x_real_time", "x_real_time_per_cpu_s", "wer")
    if header:
        print(" ".join(f"{c:>22}" for c in cols))
    print(" ".join(f"{row[c]:>22}" for c in cols), flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the speech file (default: 10)")
    parser.add_argument("--threads", type=_ints, default=[1, 2], help="whisper CPU threads to try (default: 1,2)")
    parser.add_argument("--batch", type=_ints, default=[1, 4, 8], help="utterances a pass to try (default: 1,4,8)")
    parser.add_argument("--with-llm", action="store_true",
                        help="also the command's peak RSS on the first minute with the LLM cleaner")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/file_captions.json",
                        help="write the runs here (default: %(default)s)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.minutes, args.threads, args.batch, args.with_llm, args.json_path)
