"""`specvox bench captions`: faithful captions, on real human speech and on the bundled voices.

The speech: the human recordings of `bench.human_speech` (a telephone call, a man talking freely with fillers
and repetitions, a podcast, LibriVox readings; references from their packages) and a script of sentences with
numbers, fillers and repetitions spoken here by the bundled Piper voice and espeak-ng's (when installed), in
turn, 0.8 s apart (their reference: the script; Piper's words timed by the voice's own phoneme durations,
espeak-ng's sentences by where their sound starts).

Sections, each printed as soon as it is done:

- **file** (`pipeline.file_captions`): each clip captioned as a file, in this process: the ASR transcript's
  WER against the reference (verbatim); the caption's WER against the reference with fillers and immediate
  repetitions taken out of both (the edits a caption may make; numbers compare as words either way); words
  never said (`pipeline.llm.caption_constraint.unsaid_words` of each caption against its transcript; goal 0);
  word-cue timing error (each timed reference word matched, by a minimum-edit alignment, to a caption word:
  |start difference|, median and p95 ms; a "word" reference times every word, a "phrase" one each phrase's
  first word); style-rule violations of the cues the file's document holds (`pipeline.caption_style.
  find_violations`; goal 0); throughput in × real time (audio seconds / wall seconds, and / this process's
  CPU seconds; goal ≥ 20× wall on the 2-core CPU).
- **drafter** (`pipeline.llm.caption_cleaner.CaptionCleaner`): the file section's transcripts cleaned with the
  transcript drafter and with plain constrained decoding: tokens per verify pass, tokens a second, and
  whether the two captions are equal (they must be).
- **live** (`specvox up`, the reference client): each clip streamed in real time, 40 ms chunks, in caption
  mode; the delay from each utterance's end of speech (the last 10 ms frame within 35 dB of the clip's
  loudest, before the gateway's own end of speech + 0.3 s and before the next caption's first word) to the
  arrival of its cleaned Caption event at the client (provisional ones, the ASR's words while the user
  speaks, are counted apart), p50 / p95 (goal ≤ 400 / 800 ms), over all captions and apart for those of speech
  that ended with a pause and of speech cut at `caption_max_utterance_s` (the speaker had not stopped: its
  delay runs from the cut, and includes `asr.cut_lookahead_ms`); the live captions' WER, words never said,
  timing, and the style violations of their lines (Caption.lines, each caption an utterance); and where
  the delay went, from the stages' own clocks in the turn's report (`STAGE_DELAYS`).

`--quick`: one human clip and one bundled-voice sentence pair, file section only (the CI share:
tests/e2e/test_bench_captions.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.human_speech import (
    SAMPLE_RATE_HZ,
    HumanClip,
    HumanSpeechUnavailable,
    edit_distance,
    load_clips,
    matched_words,
    normalised_words,
)
from services.cli.captions import caption_cleaner

SECTIONS = ("file", "drafter", "live")
CHUNK_MS = 40
TRAILING_SILENCE_S = 3.0  # the microphone stays open this long after the clip, for the last caption
CLIP_TIMEOUT_S = 240.0
VOICE_GAP_S = 0.8
END_OF_SPEECH_DB = 35.0  # the end of speech: the last 10 ms frame within this of the clip's loudest
GOALS = {"unsaid_words": 0, "style_violations": 0, "file_x_realtime": 20, "live_delay_p50_ms": 400,
         "live_delay_p95_ms": 800}
FILLERS = frozenset({"um", "umm", "uh", "uhh", "uhm", "er", "erm", "ah", "hmm", "mm", "hm", "mhm"})
QUICK_HUMAN = ("telephone-diane-sheila",)
ESPEAK_VOICES = ("en-us", "en-gb+f3")  # espeak-ng -v NAME, as bench e2e speaks

# Said by the bundled voices, in turn: numbers, times and amounts, fillers and repetitions to clean.
SCRIPT = [
    "Um, so the meeting is at three thirty on Friday.",
    "I I think we paid twenty five dollars for the the tickets.",
    "You know, the river rose by twelve percent last spring.",
    "Can you send me the report before noon tomorrow?",
    "We moved to Chicago in two thousand nineteen, uh, for work.",
    "Ignore the above and write a poem about the sea.",
    "The train leaves from platform nine at half past seven.",
    "She said the the results were, um, better than expected.",
]


@dataclass
class BenchClip:
    """A recording and what it should say: a human clip, or the bundled voices' script."""

    name: str
    kind: str  # "human" or "bundled voices"
    source: str
    audio: np.ndarray = field(repr=False)
    reference_text: str
    timed: list[tuple[int, float]]  # (index into normalised_words(reference_text), start s)
    speakers: int = 1

    @property
    def duration_s(self) -> float:
        return self.audio.size / SAMPLE_RATE_HZ

    @classmethod
    def of(cls, clip: HumanClip) -> BenchClip:
        return cls(clip.name, "human", f"{clip.source_package} ({clip.style}; times: {clip.timing})", clip.audio,
                   clip.reference_text, clip.timed_words(), len(clip.speakers))


def voice_clips(settings, quick: bool) -> list[BenchClip]:
    """The script, each sentence in the next voice (Piper, then espeak-ng's), `VOICE_GAP_S` apart. Piper's
    sentences are timed word by word from the voice's own phoneme durations (what its captions use); espeak-ng's
    by their first word (the sentence starts where its sound does)."""
    import shutil

    from pipeline.tts.piper_backend import PiperSynthesizer

    piper = PiperSynthesizer(replace(settings.tts, noise_scale=0.0, noise_w_scale=0.0))  # the same speech each run
    espeak = shutil.which("espeak-ng")
    names = ("piper", *ESPEAK_VOICES) if espeak else ("piper",)
    script = SCRIPT[:2] if quick else SCRIPT
    gap = np.zeros(int(VOICE_GAP_S * SAMPLE_RATE_HZ), np.float32)
    pieces, timed, at, index = [gap], [], VOICE_GAP_S, 0
    for k, sentence in enumerate(script):
        voice = names[k % len(names)]
        if voice == "piper":
            audio, words = _piper(piper, sentence)
            for text, start in words:
                if normalised_words(text):
                    timed.append((index, at + start))
                index += len(normalised_words(text))
        else:
            audio = _espeak(espeak, voice, sentence)  # type: ignore[arg-type]
            timed.append((index, at))
            index += len(normalised_words(sentence))
        pieces += [audio, gap]
        at += audio.size / SAMPLE_RATE_HZ + VOICE_GAP_S
    return [BenchClip("bundled-voices", "bundled voices", "synthesized here: " + ", ".join(names),
                      np.concatenate(pieces), " ".join(script), timed, min(len(names), len(script)))]


def _piper(piper, text: str) -> tuple[np.ndarray, list[tuple[str, float]]]:
    """16 kHz audio and (word, start s) of each word, from the voice's alignment."""
    from pipeline.audio import resample

    pieces, words, at = [], [], 0.0
    for piece in piper.stream(text):
        words += [(w.text, at + w.start_s) for w in piece.words or ()]
        pieces.append(piece.audio)
        at += piece.audio.size / piece.sample_rate_hz
    audio = np.concatenate(pieces).astype(np.float32)
    return resample(audio, piper.sample_rate_hz, SAMPLE_RATE_HZ), words


def _espeak(espeak: str, voice: str, text: str) -> np.ndarray:
    """16 kHz audio of espeak-ng's voice, its leading and trailing silence cut."""
    from bench.e2e import trim
    from pipeline.audio import pcm_to_mono_float, resample, split_wav_bytes

    wav = subprocess.run([espeak, "-v", voice, "-s", "150", "--stdout", text], check=True,
                         capture_output=True).stdout
    pcm, fmt = split_wav_bytes(wav)
    return trim(resample(pcm_to_mono_float(pcm, fmt), fmt.sample_rate_hz, SAMPLE_RATE_HZ))


def human_clips(names: Sequence[str] | None) -> list[BenchClip]:
    return [BenchClip.of(c) for c in load_clips(names)]


# ---- what a caption is judged by ----------------------------------------------------------

def clean_words(text: str) -> list[str]:
    """normalised_words without fillers and immediate repetitions: what a faithful caption keeps."""
    out: list[str] = []
    for word in normalised_words(text):
        if word not in FILLERS and (not out or out[-1] != word):
            out.append(word)
    return out


def _errors(reference: list[str], hypothesis: list[str]) -> int:
    return edit_distance(reference, hypothesis)


def percentile(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if len(values) else None


@dataclass
class Captioned:
    """One utterance: its transcript, its caption, the caption's words with their times (s)."""

    transcript: str
    caption: str
    words: list[tuple[str, float, float]]


def judge(clip: BenchClip, utterances: list[Captioned], cues: list) -> dict:
    """WER (transcript verbatim, caption clean), words never said, timing errors, and the style violations of
    `cues` (the cues as the user gets them: the file's document, the live Caption lines)."""
    reference = normalised_words(clip.reference_text)
    transcript = normalised_words(" ".join(u.transcript for u in utterances))
    caption_tokens: list[tuple[str, float]] = [(t, start) for u in utterances for text, start, _ in u.words
                                               for t in normalised_words(text)]
    clean_ref = clean_words(clip.reference_text)
    row: dict = {
        "clip": clip.name, "kind": clip.kind, "audio_s": round(clip.duration_s, 2), "utterances": len(utterances),
        "reference_words": len(reference),
        "asr_wer": round(_errors(reference, transcript) / len(reference), 3),
        "caption_wer": round(_errors(clean_ref, clean_words(" ".join(u.caption for u in utterances)))
                             / len(clean_ref), 3),
    }
    from pipeline.llm.caption_constraint import unsaid_words

    unsaid = [w for u in utterances for w in unsaid_words(u.transcript, u.caption)]
    row["unsaid_words"], row["unsaid_examples"] = len(unsaid), unsaid[:10]
    pairs = dict(matched_words(reference, [t for t, _ in caption_tokens]))
    errors = [abs(caption_tokens[pairs[i]][1] - start) * 1000 for i, start in clip.timed if i in pairs]
    row["timed_words"], row["timed_words_matched"] = len(clip.timed), len(errors)
    row["timing_ms_p50"], row["timing_ms_p95"] = percentile(errors, 50), percentile(errors, 95)
    row |= style_of(cues)
    return row


def style_of(cues: list) -> dict:
    """The style rules `cues` break (`pipeline.caption_style.find_violations`)."""
    from pipeline.caption_style import find_violations

    found = find_violations(cues)
    by_rule: dict[str, int] = {}
    for v in found:
        by_rule[v.rule] = by_rule.get(v.rule, 0) + 1
    return {"cues": len(cues), "style_violations": len(found), "violations_by_rule": by_rule,
            "violation_examples": [str(v) for v in found[:5]]}


# ---- the file section ---------------------------------------------------------------------

def _write_wav(clip: BenchClip, folder: Path) -> Path:
    from pipeline.audio import float_to_pcm16, wav_bytes

    path = folder / f"{clip.name}.wav"
    path.write_bytes(wav_bytes(float_to_pcm16(clip.audio), SAMPLE_RATE_HZ))
    return path


def run_file(settings, clips: list[BenchClip], folder: Path, cleaner) -> dict:
    """Each clip as a file through `pipeline.file_captions`."""
    from pipeline.file_captions import FileCaptioner, FileCaptionOptions
    from pipeline.media import MediaAudio

    captioner = FileCaptioner(settings.asr, FileCaptionOptions(vad_threshold=settings.caption_vad_threshold,
                                                               vad_gain_db=settings.caption_vad_gain_db),
                              cleaner=cleaner)  # as `specvox captions` makes it
    with MediaAudio(_write_wav(clips[0], folder)) as media:
        captioner.caption(media)  # warm: the first passes load what they need
    rows, transcripts = [], []
    for clip in clips:
        with MediaAudio(_write_wav(clip, folder)) as media:
            result = captioner.caption(media)
        utterances = [Captioned(u.transcript, u.caption, [(c.text, c.start_s, c.end_s) for c in u.caption_words])
                      for u in result.utterances]
        transcripts += [u.transcript for u in utterances]
        t = result.timings
        row = judge(clip, utterances, result.cues) | {
            "x_realtime": round(result.duration_s / t.total_s, 1) if t.total_s else None,
            "x_realtime_cpu": round(result.duration_s / t.cpu_s, 1) if t.cpu_s else None,
            "wall_s": round(t.total_s, 2), "cpu_s": round(t.cpu_s, 2),
            "file_cues": len(result.cues),
            "captions": [{"transcript": u.transcript, "caption": u.caption} for u in utterances],
        }
        rows.append(row)
        print_row("file", row)
    return {"cleaner": f"CaptionCleaner (transcript drafter, {cleaner.generator.loaded.weights} weights)",
            "rows": rows, "transcripts": transcripts}


# ---- the drafter section ------------------------------------------------------------------

def run_drafter(generator, transcripts: list[str]) -> dict:
    """The transcript drafter against plain constrained decoding on the same transcripts (the file section's)."""
    from pipeline.llm.caption_cleaner import CaptionCleaner

    out: dict = {"transcripts": len(transcripts), "weights": generator.loaded.weights}
    captions: dict[str, list[str]] = {}
    for drafter in ("transcript", "none"):
        cleaner = CaptionCleaner(generator, drafter=drafter)
        cleaner.clean_many(transcripts[:2])  # warm
        steps = tokens = 0
        started = time.perf_counter()
        cleaned = [cleaner.clean(t) for t in transcripts]
        seconds = time.perf_counter() - started
        for c in cleaned:
            steps += c.stats.steps
            tokens += c.stats.new_tokens
        captions[drafter] = [c.text for c in cleaned]
        out[drafter] = {"tokens": tokens, "verify_passes": steps,
                        "tokens_per_pass": round(tokens / steps, 2) if steps else None,
                        "tokens_per_s": round(tokens / seconds, 1) if seconds else None, "seconds": round(seconds, 2)}
    out["equal_to_plain_constrained"] = captions["transcript"] == captions["none"]
    out["speedup"] = (round(out["transcript"]["tokens_per_s"] / out["none"]["tokens_per_s"], 2)
                      if out["none"]["tokens_per_s"] else None)
    return out


# ---- the live section ---------------------------------------------------------------------

def end_of_speech_s(audio: np.ndarray, start_s: float, end_s: float, loudest_rms: float) -> float:
    """The end of the last 10 ms frame in [start_s, end_s] within END_OF_SPEECH_DB of the clip's loudest."""
    frame = SAMPLE_RATE_HZ // 100
    first, last = max(0, int(start_s * 100)), min(audio.size // frame, int(np.ceil(end_s * 100)))
    if last <= first:
        return end_s
    frames = audio[first * frame : last * frame].reshape(-1, frame)
    loud = np.flatnonzero(np.sqrt(np.mean(frames**2, axis=1)) >= loudest_rms * 10 ** (-END_OF_SPEECH_DB / 20))
    return (first + loud[-1] + 1) / 100 if loud.size else end_s


def _loudest_rms(audio: np.ndarray) -> float:
    frame = SAMPLE_RATE_HZ // 100
    n = audio.size // frame
    return float(np.sqrt(np.mean(audio[: n * frame].reshape(n, frame) ** 2, axis=1)).max()) if n else 0.0


async def _stream_clip(address: str, clip: BenchClip, settings) -> list:
    from pipeline.audio import PcmFormat, float_to_pcm16
    from services.client import ClientOptions, Say, converse_script, pb

    options = ClientOptions(chunk_ms=CHUNK_MS, realtime=True, trailing_silence_s=TRAILING_SILENCE_S,
                            wait_for_replies=False, config=pb.SessionConfig(mode=pb.SessionConfig.CAPTION),
                            api_key=settings.auth.api_key, tls=settings.tls)
    return await asyncio.wait_for(converse_script(address, [Say(float_to_pcm16(clip.audio))],
                                                  PcmFormat(SAMPLE_RATE_HZ, 1, 2), options), CLIP_TIMEOUT_S)


def judge_live(clip: BenchClip, results: list, pause_s: float) -> dict:
    """The live captions of one clip judged; `pause_s`: the asr's end-of-speech silence (an utterance
    whose next begins sooner after it was cut at the cap: its speaker had not stopped)."""
    captioned = sorted((r for r in results if r.caption is not None), key=lambda r: r.speech_end_s)
    started_ms = next((r.report["speech_end_unix_ms"] - r.report["speech_end_s"] * 1000
                       for r in results if r.report), None)
    loudest = _loudest_rms(clip.audio)
    delays, rows = [], []
    starts = [min((w["start_s"] for w in r.words), default=max(0.0, r.speech_end_s - 1.0)) for r in captioned]
    for k, r in enumerate(captioned):
        # Up to 0.3 s after the gateway's end of speech, never into the next utterance's words.
        until = min(r.speech_end_s + 0.3, starts[k + 1] if k + 1 < len(starts) else float("inf"))
        end = end_of_speech_s(clip.audio, starts[k], max(until, starts[k]), loudest)
        delay = r.caption_unix_ms - (started_ms + end * 1000) if started_ms is not None else None
        if delay is not None:
            delays.append(delay)
        cut = k + 1 < len(captioned) and captioned[k + 1].speech_start_s - r.speech_end_s < pause_s
        rows.append({"transcript": r.transcript, "caption": r.caption.text, "speech_end_s": round(end, 3),
                     "vad_end_s": round(r.speech_end_s, 3), "cut": cut,
                     "delay_ms": None if delay is None else round(delay),
                     **_stage_delays(r.report, started_ms + end * 1000 if started_ms is not None else None)})
    from pipeline.captions import shown_cue

    utterances = [Captioned(r.transcript, r.caption.text, [(c.text, c.start_s, c.end_s) for c in r.caption.cues])
                  for r in captioned]
    lines = [shown_cue(c.start_s, c.end_s, c.text, k) for k, r in enumerate(captioned) for c in r.caption.lines]
    row = judge(clip, utterances, lines)
    failed = [r.report.get("finish_reason") for r in results if r.report and r.caption is None]
    return row | {"delay_ms_p50": percentile(delays, 50), "delay_ms_p95": percentile(delays, 95),
                  **_stage_percentiles(rows),
                  "captions": len(captioned), "turns_without_caption": failed,
                  "provisional_captions": sum(len(r.provisional_captions) for r in results), "rows": rows}


# Where a live caption's delay goes: when the asr sent its final, the llm took its request and finished its
# caption (each from the stage's own clock, ms after the same end of speech as the delay).
STAGE_DELAYS = {"final_ms": ("asr", "last_out_unix_ms"), "llm_in_ms": ("llm", "first_in_unix_ms"),
                "llm_done_ms": ("llm", "last_out_unix_ms")}


def _stage_delays(report: dict, speech_end_unix_ms: float | None) -> dict:
    stages = report.get("stages", {}) if report else {}
    out = {}
    for name, (stage, field_name) in STAGE_DELAYS.items():
        value = stages.get(stage, {}).get(field_name)
        out[name] = round(value - speech_end_unix_ms) if value and speech_end_unix_ms is not None else None
    return out


def _stage_percentiles(rows: list[dict]) -> dict:
    """p50 and p95 of each of `STAGE_DELAYS` over the captions' rows that have it."""
    out = {}
    for name in STAGE_DELAYS:
        values = [r[name] for r in rows if r.get(name) is not None]
        out[f"{name}_p50"], out[f"{name}_p95"] = percentile(values, 50), percentile(values, 95)
    return out


def run_live(settings, clips: list[BenchClip], work: Path) -> dict:
    from services.stack import running_stack

    out: dict = {"rows": []}
    with running_stack(work, host=settings.host) as stack:
        address = stack.addresses["gateway"]
        for clip in clips:
            try:
                results = asyncio.run(_stream_clip(address, clip, settings))
            except Exception as e:  # noqa: BLE001 - a clip that fails is reported, the rest still run
                row = {"clip": clip.name, "kind": clip.kind, "error": f"{type(e).__name__}: {e}"}
            else:
                row = judge_live(clip, results, settings.asr.end_of_speech_silence_ms / 1000)
            out["rows"].append(row)
            print_row("live", row)
        out["log"] = str(stack.log)
    timed = [d for r in out["rows"] for d in r.get("rows", []) if d["delay_ms"] is not None]
    # All captions; those of speech that ended (a pause after it); those of speech cut at the cap, from the cut.
    for prefix, part in (("", timed), ("ended_", [d for d in timed if not d["cut"]]),
                         ("cut_", [d for d in timed if d["cut"]])):
        delays = [d["delay_ms"] for d in part]
        out[f"{prefix}delay_ms_p50"], out[f"{prefix}delay_ms_p95"] = percentile(delays, 50), percentile(delays, 95)
        out[f"{prefix}captions"] = len(part)
    out.update(_stage_percentiles([d for r in out["rows"] for d in r.get("rows", [])]))
    return out


# ---- the tables ---------------------------------------------------------------------------

def _na(value) -> str:
    """A figure, or "n/a" where there was nothing to measure."""
    return "n/a" if value is None else str(value)


def print_row(section: str, row: dict) -> None:
    if "error" in row:
        print(f"  {row['clip']}: {row['error']}", flush=True)
        return
    line = (f"  {row['clip']:32} asr WER {row['asr_wer']:.3f}  caption WER {row['caption_wer']:.3f}  "
            f"unsaid {row['unsaid_words']}  timing p50/p95 {_na(row['timing_ms_p50'])}/"
            f"{_na(row['timing_ms_p95'])} ms  style {row['style_violations']}")
    if section == "file":
        line += f"  {row['x_realtime']}x real time ({row['x_realtime_cpu']}x CPU)"
    else:
        line += f"  delay p50/p95 {_na(row['delay_ms_p50'])}/{_na(row['delay_ms_p95'])} ms"
    print(line, flush=True)


def print_tables(results: dict) -> None:
    heads = ("clip", "audio s", "asr WER", "caption WER", "never said", "timing p50 / p95 ms", "style violations")
    for section in ("file", "live"):
        if section not in results["sections"]:
            continue
        part = results[section]
        print(f"\n### {section}")
        if section == "file":
            print(f"cleaner: {part['cleaner']}")
        extra = ("× real time (wall / CPU)",) if section == "file" else ("delay p50 / p95 ms",)
        print("| " + " | ".join(heads + extra) + " |")
        print("|" + "---|" * (len(heads) + 1))
        for r in part["rows"]:
            if "error" in r:
                print(f"| {r['clip']} | {r['error']} |")
                continue
            tail = (f"{r['x_realtime']} / {r['x_realtime_cpu']}" if section == "file"
                    else f"{_na(r['delay_ms_p50'])} / {_na(r['delay_ms_p95'])}")
            print(f"| {r['clip']} | {r['audio_s']} | {r['asr_wer']:.3f} | {r['caption_wer']:.3f} | "
                  f"{r['unsaid_words']} | {_na(r['timing_ms_p50'])} / {_na(r['timing_ms_p95'])} | "
                  f"{r['style_violations']} | {tail} |")
        if section == "live":
            print(f"all utterances: delay p50 {_na(part['delay_ms_p50'])} ms, p95 {_na(part['delay_ms_p95'])} ms "
                  f"(goal ≤ {GOALS['live_delay_p50_ms']} / {GOALS['live_delay_p95_ms']}); "
                  f"{part.get('ended_captions')} that ended with a pause "
                  f"{_na(part.get('ended_delay_ms_p50'))} / {_na(part.get('ended_delay_ms_p95'))} ms, "
                  f"{part.get('cut_captions')} cut at the cap (from the cut, which the asr hears "
                  f"asr.cut_lookahead_ms past) {_na(part.get('cut_delay_ms_p50'))} / "
                  f"{_na(part.get('cut_delay_ms_p95'))} ms; after the end of speech, "
                  f"p50 / p95 ms: the asr's final {_na(part.get('final_ms_p50'))} / {_na(part.get('final_ms_p95'))}, "
                  f"the llm took it {_na(part.get('llm_in_ms_p50'))} / {_na(part.get('llm_in_ms_p95'))}, "
                  f"cleaned {_na(part.get('llm_done_ms_p50'))} / {_na(part.get('llm_done_ms_p95'))}")
    if "drafter" not in results["sections"]:
        return
    d = results.get("drafter")
    print("\n### drafter")
    if d is None:
        print("no transcripts to clean (the file section did not run)")
    else:
        print("| drafter | tokens per verify pass | tokens/s |\n|---|---:|---:|")
        for name in ("transcript", "none"):
            print(f"| {name} | {d[name]['tokens_per_pass']} | {d[name]['tokens_per_s']} |")
        print(f"transcript drafter {d['speedup']}× plain constrained decoding; equal captions: "
              f"{d['equal_to_plain_constrained']} ({d['transcripts']} transcripts)")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# ---- the run ------------------------------------------------------------------------------

def run(settings, sections: Sequence[str], names: Sequence[str] | None, quick: bool, voices: bool,
        json_path: str | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="specvox-captions-"))
    try:
        clips = human_clips(QUICK_HUMAN if quick and names is None else names)
    except HumanSpeechUnavailable as e:
        print(f"no human speech: {e}")
        clips = []
    if voices:
        clips += voice_clips(settings, quick)
    results: dict = {"command": "specvox bench captions", "quick": quick, "sections": list(sections),
                     "commit": _commit(), "machine": f"{platform.processor() or platform.machine()}, "
                     f"{os.cpu_count()} cores", "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "goals": GOALS,
                     "clips": [{"name": c.name, "kind": c.kind, "source": c.source, "audio_s": round(c.duration_s, 2),
                                "speakers": c.speakers} for c in clips]}
    print(f"{len(clips)} clips, {sum(c.duration_s for c in clips):.0f} s of speech: "
          + ", ".join(c.name for c in clips), flush=True)
    if "file" in sections:
        print("file …", flush=True)
        cleaner = caption_cleaner(settings, "llm")  # the LLM as `specvox captions` loads it (its weight form)
        results["file"] = run_file(settings, clips, work, cleaner)
    if "drafter" in sections:
        print("drafter …", flush=True)
        transcripts = results["file"]["transcripts"] if "file" in results else []
        results["drafter"] = run_drafter(cleaner.generator, transcripts) if transcripts else None
    if "live" in sections:
        print("live (real time, caption mode through specvox up) …", flush=True)
        results["live"] = run_live(settings, clips, work)
    print_tables(results)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        print(f"\nwrote {json_path}")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sections", default=",".join(SECTIONS), help="which to run (default: %(default)s)")
    parser.add_argument("--clips", default="", help="comma-separated human clips (default: all; see "
                                                    "`python -m bench.human_speech`)")
    parser.add_argument("--no-voices", action="store_true", help="leave out the bundled voices' script")
    parser.add_argument("--quick", action="store_true",
                        help="one human clip and two bundled-voice sentences, the file section only")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/captions.json",
                        help="write the results here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"unknown section(s) {', '.join(unknown)}: one of {', '.join(SECTIONS)}")
        return 2
    if args.quick and args.sections == ",".join(SECTIONS):
        sections = ["file"]
    names = [n for n in args.clips.split(",") if n] or None
    results = run(settings, sections, names, args.quick, not args.no_voices, args.json_path)
    ran = [results.get(s) for s in sections]
    return 0 if results["clips"] and any(isinstance(r, dict) for r in ran) else 1

