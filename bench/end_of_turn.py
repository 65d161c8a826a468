"""`specvox bench end-of-turn`: does a pause inside a sentence look like the end of the turn?

Each case is a turn spoken by the bundled Piper voice (noise off) and by espeak-ng (when
installed): either one complete sentence, or a sentence spoken in parts with a real silence
of 300-700 ms between them ("Hello," [500 ms] "can you tell me what time it is?"). Each part
is synthesized on its own, trimmed to its spoken span, and the parts are joined with exactly
that silence. The audio goes to the streaming recognizer (`StreamingRecognizer`, the
configured `asr` options: by default an utterance closes after 150 ms of silence) in 20 ms
chunks, as a WebRTC client sends them. At every utterance the recognizer closes, the text
end-of-turn scorer (`pipeline.llm.end_of_turn`) scores the turn's text so far (the finals
of the turn joined), under each normalisation, and, if its model file is at hand, so does
the acoustic Smart Turn v3.2 model on the turn's audio up to that moment.

A close is at the **end** when the VAD's end of speech is within 0.3 s of where the turn's
speech really ends, else at a **pause** (one of the silences put in, or a split inside a
part). At a threshold T a close is judged complete when its score is >= T:

- a **false cut-off** is a pause close judged complete (the avatar would answer half a sentence);
- a **late end** is an end close judged incomplete (the gateway waits its extra silence for nothing).

The policy is chosen by the least 2 x false cut-offs + late ends over both voices (a cut-off
is worse than a wait). Smart Turn needs `smart-turn-v3.2-cpu.onnx` from the `pipecat-ai`
1.14 wheel: set SMART_TURN_ONNX to the file, or have pipecat-ai installed; otherwise it is
left out. Fetch it with `pip download --no-deps "pipecat-ai==1.14.*" -d /tmp/pc` and
`unzip /tmp/pc/pipecat_ai-*.whl 'pipecat/audio/turn/smart_turn/data/*' -d /tmp/pc`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.asr import SPEECH_FLOOR_DB, spoken_span_s, voices
from pipeline.asr import SAMPLE_RATE_HZ, Transcriber
from pipeline.asr_stream import FinalTranscript, StreamingRecognizer
from pipeline.llm.end_of_turn import (
    COMPLETE_THRESHOLD,
    DEFAULT_NORMALISATION,
    INCOMPLETE_WAIT_MS,
    NORMALISATIONS,
    EndOfTurnScorer,
)
from pipeline.llm.model import load_model

CHUNK_MS = 20
FRAME = SAMPLE_RATE_HZ // 100  # 10 ms
LEAD_S, TRAIL_S = 0.6, 1.5
EDGE_S = 0.02  # speech kept either side of a part's spoken span
END_TOLERANCE_S = 0.3  # a close whose speech ends this near the turn's real end is at the end
THRESHOLDS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 0.5)
SMART_TURN_THRESHOLDS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
SMART_TURN_S = 8  # Smart Turn v3 hears the turn's last 8 s
SMART_TURN_IN_PIPECAT = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
SMART_TURN_PRE_SPEECH_S = 0.5  # audio kept before the turn's speech starts (Pipecat's pre_speech_ms)
CUTOFF_WEIGHT = 2  # a false cut-off costs this many late ends in the choice of the threshold


@dataclass(frozen=True)
class Case:
    parts: tuple[str, ...]
    pauses_ms: tuple[int, ...] = ()  # silence after each part but the last

    @property
    def text(self) -> str:
        return " ".join(self.parts)


def _case(*items: str | int) -> Case:
    return Case(tuple(i for i in items if isinstance(i, str)), tuple(i for i in items if isinstance(i, int)))


# Written for this benchmark (not from shared/data/prompts.json): pauses at commas, fillers,
# trailing-off, lists, a question after a greeting, and a pause with no comma at all.
PAUSED = (
    _case("Hello,", 500, "can you tell me what time it is?"),
    _case("Hi there,", 450, "what's the weather like today?"),
    _case("I want to,", 400, "um,", 500, "ask you something about my order."),
    _case("What about...", 600, "the weather tomorrow?"),
    _case("So,", 500, "I was wondering if you could help me."),
    _case("I need eggs,", 350, "milk,", 350, "and some bread."),
    _case("My favorite colors are red,", 400, "blue,", 400, "and green."),
    _case("Could you remind me", 400, "to call my mother tonight?"),
    _case("Well,", 500, "I think the first option is better."),
    _case("Okay,", 450, "and what should I do next?"),
    _case("The thing is,", 600, "I don't really like coffee."),
    _case("If it rains tomorrow,", 500, "should I take the bus?"),
    _case("Tell me about", 500, "the history of Rome."),
    _case("I'd like to book a table for", 450, "four people at eight."),
    _case("Good morning,", 500, "how are you doing today?"),
    _case("Can you, uh,", 400, "recommend a good movie?"),
    _case("First I want to know", 600, "how far away the moon is."),
    _case("Let me think,", 700, "how about next Friday?"),
    _case("Yesterday I went to the park and", 500, "I saw a big dog."),
    _case("Excuse me,", 400, "where is the nearest station?"),
    _case("Um,", 500, "what's your name?"),
    _case("I'm looking for a gift for my sister,", 500, "something under fifty dollars."),
)
COMPLETE = (
    _case("Can you tell me the time?"),
    _case("What is the capital of France?"),
    _case("I would like a cup of tea."),
    _case("How do I make pancakes?"),
    _case("Thank you very much."),
    _case("Where can I park my car?"),
    _case("Please set an alarm for seven."),
    _case("Why is the sky blue?"),
)
CASES = PAUSED + COMPLETE


def build_audio(speak, case: Case) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The case's audio and each part's spoken span (s) in it."""
    pieces, spans = [np.zeros(int(LEAD_S * SAMPLE_RATE_HZ), np.float32)], []
    at = pieces[0].size
    edge = int(EDGE_S * SAMPLE_RATE_HZ)
    for i, part in enumerate(case.parts):
        speech = speak(part)
        start_s, end_s = spoken_span_s(speech)
        lo, hi = max(0, int(start_s * SAMPLE_RATE_HZ) - edge), min(speech.size, int(end_s * SAMPLE_RATE_HZ) + edge)
        pieces.append(speech[lo:hi].astype(np.float32))
        spans.append(((at + int(start_s * SAMPLE_RATE_HZ) - lo) / SAMPLE_RATE_HZ,
                      (at + int(end_s * SAMPLE_RATE_HZ) - lo) / SAMPLE_RATE_HZ))
        at += hi - lo
        gap_s = case.pauses_ms[i] / 1000 if i < len(case.pauses_ms) else TRAIL_S
        pieces.append(np.zeros(int(gap_s * SAMPLE_RATE_HZ), np.float32))
        at += pieces[-1].size
    return np.concatenate(pieces), spans


def closes(recognizer: StreamingRecognizer, audio: np.ndarray) -> list[tuple[int, FinalTranscript]]:
    """Each final the recognizer emits, with the samples it had been fed when it did."""
    chunk = CHUNK_MS * SAMPLE_RATE_HZ // 1000
    out = []
    for fed in range(0, audio.size, chunk):
        end = min(audio.size, fed + chunk)
        out += [(end, e) for e in recognizer.feed(audio[fed:end]) if isinstance(e, FinalTranscript)]
    return out + [(audio.size, e) for e in recognizer.finish() if isinstance(e, FinalTranscript)]


class SmartTurn:
    """Smart Turn v3.2 (Pipecat's acoustic end-of-turn model) on onnxruntime, as Pipecat calls it."""

    def __init__(self, path: str) -> None:
        import onnxruntime as ort
        from transformers import WhisperFeatureExtractor

        options = ort.SessionOptions()
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads, options.intra_op_num_threads = 1, 1
        self.session = ort.InferenceSession(path, sess_options=options)
        self.features = WhisperFeatureExtractor(chunk_length=SMART_TURN_S)

    def probability(self, audio: np.ndarray) -> tuple[float, float]:
        """P(complete) of the audio's last 8 s (zeros before a shorter one), and the ms it took."""
        started = time.perf_counter()
        n = SMART_TURN_S * SAMPLE_RATE_HZ
        audio = audio[-n:] if audio.size >= n else np.pad(audio, (n - audio.size, 0))
        features = self.features(audio, sampling_rate=SAMPLE_RATE_HZ, return_tensors="np", padding="max_length",
                                 max_length=n, truncation=True, do_normalize=True).input_features
        out = self.session.run(None, {"input_features": features.astype(np.float32)})
        return float(np.asarray(out[0]).reshape(-1)[0]), (time.perf_counter() - started) * 1000


def smart_turn_path() -> str | None:
    path = os.environ.get("SMART_TURN_ONNX")
    if path:
        return path if Path(path).is_file() else None
    spec = importlib.util.find_spec("pipecat")
    if spec and spec.submodule_search_locations:
        found = Path(next(iter(spec.submodule_search_locations))) / SMART_TURN_IN_PIPECAT
        return str(found) if found.is_file() else None
    return None


def run(settings, json_path: str | None) -> int:
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)
    transcriber = Transcriber(settings.asr)
    transcriber.warm_up()
    scorer = EndOfTurnScorer(load_model(settings.llm))
    for mode in NORMALISATIONS:
        scorer.score("Hello there.", normalisation=mode)  # first passes pay for allocations
    onnx = smart_turn_path()
    smart = SmartTurn(onnx) if onnx else None
    if smart is None:
        print("Smart Turn v3.2 not found (SMART_TURN_ONNX, or pipecat-ai installed): text scores only")
    rows = []
    for voice, speak in voices(settings).items():
        for number, case in enumerate(CASES):
            audio, spans = build_audio(speak, case)
            rows += case_rows(voice, number, case, audio, spans, StreamingRecognizer(settings.asr, transcriber),
                              scorer, smart)
        print(f"  {voice}: {len(CASES)} cases", flush=True)
    summary = summarise(rows, smart is not None)
    print_rows(rows)
    print_summary(summary)
    if json_path:
        out = {"summary": summary, "asr_end_of_speech_silence_ms": settings.asr.end_of_speech_silence_ms,
               "chunk_ms": CHUNK_MS, "smart_turn_model": onnx, "rows": rows}
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def case_rows(voice: str, number: int, case: Case, audio: np.ndarray, spans: list[tuple[float, float]],
              recognizer: StreamingRecognizer, scorer: EndOfTurnScorer, smart: SmartTurn | None) -> list[dict]:
    rows, texts = [], []
    loud = loud_frames(audio)
    true_end_s = spans[-1][1]
    turn_start = max(0, int((spans[0][0] - SMART_TURN_PRE_SPEECH_S) * SAMPLE_RATE_HZ))
    for index, (fed, final) in enumerate(closes(recognizer, audio)):
        texts.append(final.text)
        text = " ".join(t for t in texts if t)
        speech_end_s = final.utterance.speech_end_s
        at_end = speech_end_s >= true_end_s - END_TOLERANCE_S
        pause = next((i for i, (_, end_s) in enumerate(spans[:-1])
                      if abs(speech_end_s - end_s) < END_TOLERANCE_S), None)
        row: dict = {"voice": voice, "case": number, "spoken": case.text, "paused": bool(case.pauses_ms),
                     "close": index, "label": "end" if at_end else "pause",
                     "where": "end" if at_end else (f"pause {pause + 1}" if pause is not None else "inside a part"),
                     "speech_end_s": round(speech_end_s, 3), "true_end_s": round(true_end_s, 3),
                     "utterance_text": final.text, "text": text}
        if text:
            for mode in NORMALISATIONS:
                result = scorer.score(text, normalisation=mode)
                row[f"p_{mode}"], row[f"ms_{mode}"] = result.probability, round(result.compute_ms, 1)
            row["prompt_tokens"] = result.prompt_tokens
        if smart is not None:
            p, ms = smart.probability(audio[turn_start:fed])
            row["p_smart_turn"], row["ms_smart_turn"] = p, round(ms, 1)
        # the silence left after the close before the user speaks on: what an extra wait must cover
        ahead = np.flatnonzero(loud[fed // FRAME :])
        row["resumes_after_close_ms"] = None if at_end or not ahead.size else round(
            ((fed // FRAME + ahead[0]) * FRAME - fed) * 1000 / SAMPLE_RATE_HZ)
        rows.append(row)
    return rows


def loud_frames(audio: np.ndarray) -> np.ndarray:
    """Which 10 ms frames hold speech: within SPEECH_FLOOR_DB of the loudest (as bench.asr finds speech)."""
    frames = audio[: audio.size // FRAME * FRAME].reshape(-1, FRAME)
    rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    return rms >= rms.max() * 10 ** (-SPEECH_FLOOR_DB / 20)


def _methods(with_smart: bool) -> list[tuple[str, tuple[float, ...]]]:
    smart = [("smart_turn", SMART_TURN_THRESHOLDS)] if with_smart else []
    return [(mode, THRESHOLDS) for mode in NORMALISATIONS] + smart


def summarise(rows: list[dict], with_smart: bool) -> dict:
    summary: dict = {"policy": {"normalisation": DEFAULT_NORMALISATION, "complete_threshold": COMPLETE_THRESHOLD,
                                "incomplete_wait_ms": INCOMPLETE_WAIT_MS}}
    groups = {voice: [r for r in rows if r["voice"] == voice] for voice in dict.fromkeys(r["voice"] for r in rows)}
    groups["all"] = rows
    for name, mine in groups.items():
        scored = [r for r in mine if "p_raw" in r]
        ends = [r for r in scored if r["label"] == "end"]
        pauses = [r for r in scored if r["label"] == "pause"]
        s: dict = {"closes": len(mine), "end_closes": len(ends), "pause_closes": len(pauses),
                   "pause_closes_at_put_in_pauses": sum(r["where"].startswith("pause ") for r in pauses),
                   "pause_closes_inside_parts": sum(r["where"] == "inside a part" for r in pauses),
                   "pauses_put_in": sum(len(c.pauses_ms) for c in CASES) * (len(groups) - 1 if name == "all" else 1),
                   "unscored_closes": len(mine) - len(scored)}
        gaps = [r["resumes_after_close_ms"] for r in pauses if r["resumes_after_close_ms"] is not None]
        s["resumes_after_close_ms_max"] = max(gaps) if gaps else None
        for method, thresholds in _methods(with_smart):
            key = f"p_{method}"
            if not all(key in r for r in scored):
                continue
            m: dict = {"auc": _auc([r[key] for r in ends], [r[key] for r in pauses]), "at": {}}
            for t in thresholds:
                cut = sum(r[key] >= t for r in pauses)
                late = sum(r[key] < t for r in ends)
                m["at"][f"{t:g}"] = {"false_cutoffs": cut, "late_ends": late, "cost": CUTOFF_WEIGHT * cut + late}
            best = min(m["at"].items(), key=lambda kv: (kv[1]["cost"], kv[1]["false_cutoffs"]))
            m["best_threshold"], m["best"] = float(best[0]), best[1]
            times = [r[f"ms_{method}"] for r in scored]
            m["ms_p50"], m["ms_p95"] = round(statistics.median(times), 1), round(float(np.percentile(times, 95)), 1)
            s[method] = m
        if scored:
            s["prompt_tokens_p50"] = statistics.median(r["prompt_tokens"] for r in scored)
        s["policies"] = {label: _policy(mine, key, wait) for label, key, wait in _policies(with_smart)}
        summary[name] = s
    return summary


def _policies(with_smart: bool) -> list[tuple[str, str, Callable[[float], int]]]:
    """(name, score key, extra silence awaited after a close with that score) for each policy compared."""
    fixed = [(f"silence only, +{extra} ms", "p_raw", lambda p, extra=extra: extra) for extra in (0, 350, 700)]
    by_score = [(f"{DEFAULT_NORMALISATION} p>={t:g} now, else +{INCOMPLETE_WAIT_MS} ms", f"p_{DEFAULT_NORMALISATION}",
                 lambda p, t=t: 0 if p >= t else INCOMPLETE_WAIT_MS)
                for t in sorted({0.003, 0.01, COMPLETE_THRESHOLD, 0.1})]
    smart = [(f"smart_turn p>=0.5 now, else +{INCOMPLETE_WAIT_MS} ms", "p_smart_turn",
              lambda p: 0 if p >= 0.5 else INCOMPLETE_WAIT_MS)] if with_smart else []
    return fixed + by_score + smart


def _policy(rows: list[dict], key: str, wait: Callable[[float], int]) -> dict:
    """A pause close is a cut-off when the silence awaited after it is shorter than the user's pause;
    an end close costs the wait (a late end when it is more than none). A close with no text yet
    (whisper heard no words) has nothing to answer: it scores 0, so it waits."""
    cut = [r for r in rows if r["label"] == "pause" and wait(r.get(key, 0.0)) < (r["resumes_after_close_ms"] or 0)]
    waits = [wait(r.get(key, 0.0)) for r in rows if r["label"] == "end"]
    return {"false_cutoffs": len(cut), "turns_cut_off": len({(r["voice"], r["case"]) for r in cut}),
            "late_ends": sum(w > 0 for w in waits),
            "end_wait_ms_mean": round(statistics.mean(waits)) if waits else None}


def _auc(positives: list[float], negatives: list[float]) -> float | None:
    """P(an end close scores above a pause close), ties half: how well a score separates the two."""
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return round(wins / (len(positives) * len(negatives)), 3)


def print_rows(rows: list[dict]) -> None:
    modes = [m for m in (*NORMALISATIONS, "smart_turn") if any(f"p_{m}" in r for r in rows)]
    print(f"\n{'voice':<10} {'close':<14} " + " ".join(f"{m:>11}" for m in modes) + "  text")
    for r in rows:
        cells = " ".join(f"{r[f'p_{m}']:>11.2e}" if f"p_{m}" in r else f"{'-':>11}" for m in modes)
        print(f"{r['voice']:<10} {r['where']:<14} {cells}  {r['text']}")


def print_summary(summary: dict) -> None:
    for name, s in summary.items():
        if name == "policy":
            continue
        print(f"\n== {name}: {s['closes']} closes, {s['end_closes']} at the end, {s['pause_closes']} at a pause "
              f"({s['pause_closes_at_put_in_pauses']} at the {s['pauses_put_in']} pauses put in, "
              f"{s['pause_closes_inside_parts']} inside a part); speech resumed at most "
              f"{s['resumes_after_close_ms_max']} ms after a pause close")
        methods = [m for m in (*NORMALISATIONS, "smart_turn") if m in s]
        print(f"{'':<12}" + "".join(f"{m:>14}" for m in methods))
        print(f"{'AUC':<12}" + "".join(f"{s[m]['auc']!s:>14}" for m in methods))
        print(f"{'ms p50/p95':<12}" + "".join(f"{s[m]['ms_p50']:>8}/{s[m]['ms_p95']:<5}" for m in methods))
        print("false cut-offs / late ends at threshold T:")
        for t in THRESHOLDS:
            print(f"{f'T={t:g}':<12}" + "".join(f"{_cell(s[m], t):>14}" for m in methods if m != "smart_turn"))
        if "smart_turn" in s:
            print("smart_turn: " + ", ".join(f"T={t:g} {_cell(s['smart_turn'], t)}" for t in SMART_TURN_THRESHOLDS))
        print("policies: false cut-offs (turns cut off) / late ends, mean extra wait at the end:")
        for label, p in s["policies"].items():
            print(f"  {label:<40} {p['false_cutoffs']:>3} ({p['turns_cut_off']}) / {p['late_ends']:>3}, "
                  f"{p['end_wait_ms_mean']} ms")
        print("best (least 2 x cut-offs + late): " + ", ".join(
            f"{m} T={s[m]['best_threshold']:g} {s[m]['best']['false_cutoffs']}/{s[m]['best']['late_ends']}"
            for m in methods))
    p = summary["policy"]
    print(f"\npolicy: {p['normalisation']}, complete if p >= {p['complete_threshold']:g}, "
          f"else wait up to {p['incomplete_wait_ms']} ms more silence")


def _cell(method: dict, t: float) -> str:
    at = method["at"].get(f"{t:g}")
    return f"{at['false_cutoffs']}/{at['late_ends']}" if at else "-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/end_of_turn.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.json_path)
