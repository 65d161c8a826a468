"""`specvox bench e2e`: whole conversations through `specvox up`, several sessions at once.

Each session is a reference client (`services.client.converse_script`) that speaks a script
of real speech in real time (the bundled Piper voice and espeak-ng voices, alternating
between sessions and turns) and plays the replies as a loudspeaker would. The script cycles
through five kinds of turn:

- ``question``: a question, answered and heard out;
- ``follow-up``: a question that builds on the reply before it (heard first);
- ``backchannel``: a question whose reply gets "Yeah." / "Mm-hmm." / "Okay." during
  playback, which must not interrupt it (a *false interruption* if it does);
- ``interrupt``: a question whose reply another question speaks over ~1 s into playback;
- ``pause``: a question with 400-600 ms of real silence inside it ("Hello," … "can you tell
  me a fun fact about owls?"); an answered turn without the second part was *cut off* at
  the pause.

Over all answered turns it reports voice to voice (client-measured end of speech → first
reply audio) and each stage's ms after the end of speech (asr final, llm first token, tts
first audio, gateway first reply output), the pause latency (the client's receipt of
`pause` minus the onset of the speech that caused it, found by an energy threshold in the
utterance's audio), false interruptions, in-sentence cut-offs, budget misses and
degradations; at each session count, with the goals beside the figures. Writes JSON (per
session count: the figures and the raw rows) and a per-stage waterfall PNG.

Each cycle of five turns is one gateway session (see KINDS for why not more), run as one
Converse stream per script turn (a follow-up shares its question's; see `segments`), so the
history carries over. A barge-in said after the reply it meant to speak over had ended is
not measured (counted apart).
A backchannel makes no turn, and `converse_script` with `wait_for_replies=True` waits for a
reply to every utterance said, so a stream that ends in one closes its microphone a few
seconds after it (`wait_for_replies=False`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.audio import PcmFormat, float_to_pcm16, pcm_to_mono_float, resample, split_wav_bytes
from pipeline.llm.prompt_sets import load_prompts

RATE_HZ = 16_000
FMT = PcmFormat(RATE_HZ, 1, 2)
MAX_REPLY_TOKENS = 48
CHUNK_MS = 40
BARGE_IN_AFTER_S = 1.0
BACKCHANNEL_TAIL_S = 3.0  # microphone silence after a backchannel that ends a segment
SEGMENT_TIMEOUT_S = 150.0  # the client's own deadline is 180 s
SESSION_STAGGER_S = 0.7  # concurrent sessions start this far apart, not in lockstep
ONSET_RMS = 0.01  # speech onset: the first 10 ms frame above -40 dBFS RMS
ANSWERED = ("eos", "length", "stop", "interrupted")
# The interrupt comes late in a cycle, and each cycle is a fresh session: a reply cut off in the
# history ends in " —" (pipeline/llm/prompts.py), and the bundled 135M model then answers every
# later turn of the session with "The answer is —" (1 s of audio, over before a barge-in at 1 s).
KINDS = ("question", "follow-up", "backchannel", "interrupt", "pause")
CUT_OFF_MARK = "—"
# "piper" is the bundled voice; the others are espeak-ng voices (-v NAME -s 150).
VOICES = ("piper", "en-us", "en-gb+f3", "en-us+m3")
GOALS = {"1": {"p50": 500, "p95": 800}, "4": {"p95": 1500}}
PAUSE_GOAL_P95_MS = 250

QUESTIONS = [  # our own, mixed with the dialogue prompt set
    "What is the tallest mountain in the world?",
    "Why is the ocean salty?",
    "How do airplanes stay up in the air?",
    "What should I pack for a weekend at the beach?",
    "What is a good name for a golden retriever puppy?",
    "How far away is the moon from the earth?",
    "What makes a rainbow appear in the sky?",
    "How do I keep my coffee hot for longer?",
]
FOLLOW_UPS = ["Can you tell me more about that?", "Why is that?", "Could you say that more simply?",
              "And what else should I know?"]
INTERRUPTIONS = ["Wait, what time is it in Tokyo?", "Sorry, how do I boil an egg?",
                 "Hold on, what is the capital of France?", "Stop, how many legs does a spider have?"]
BACKCHANNELS = ["Yeah.", "Mm-hmm.", "Okay."]
PAUSED = [  # (before the silence, after it)
    ("Hello,", "can you tell me a fun fact about owls?"),
    ("Excuse me,", "what do pandas like to eat?"),
    ("I have a question,", "how do volcanoes form?"),
    ("Hey there,", "why do zebras have stripes?"),
]


@dataclass
class Line:
    """One utterance of a session's script, with what it is for."""

    kind: str  # one of KINDS, "barge-in" or "backchannel-word"
    text: str
    voice: str
    samples: np.ndarray
    barge_in_after_s: float | None = None
    silence_ms: int = 0  # pause: the silence inside it
    turn: int = 0  # the script turn this utterance belongs to

    @property
    def onset_ms(self) -> float:
        return speech_onset_s(self.samples) * 1000


@dataclass
class Outcome:
    """What happened to one script turn."""

    session: int
    turn: int
    kind: str
    voice: str
    text: str
    rows: list[dict] = field(default_factory=list)  # its answered turns
    pause_ms: float | None = None  # barge-in kinds: pause receipt − onset of the speech over the reply
    interrupted: bool | None = None  # barge-in kinds: the spoken-over reply was interrupted
    false_interruption: bool | None = None
    cut_at_pause: bool | None = None
    reply_over: bool = False  # barge-in kinds: said after the reply had ended, so not measured
    note: str = ""

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "rows"} | {"answered_turns": len(self.rows)}


# ---- speech -------------------------------------------------------------------------------

class Voices:
    def __init__(self, settings) -> None:
        from pipeline.tts.synthesizers import load_synthesizer

        self.piper = load_synthesizer(settings.tts)
        self.espeak = shutil.which("espeak-ng")

    def names(self) -> tuple[str, ...]:
        return VOICES if self.espeak else VOICES[:1]

    def speak(self, text: str, voice: str) -> np.ndarray:
        """Mono float32 at 16 kHz, the voice's own leading and trailing silence trimmed."""
        if voice == "piper":
            from pipeline.tts.speech_text import speech_text

            audio = self.piper.synthesize(speech_text(text).spoken, RATE_HZ)
        else:
            wav = subprocess.run([self.espeak, "-v", voice, "-s", "150", "--stdout", text],
                                 check=True, capture_output=True).stdout
            pcm, fmt = split_wav_bytes(wav)
            audio = resample(pcm_to_mono_float(pcm, fmt), fmt.sample_rate_hz, RATE_HZ)
        return trim(audio)


def frame_rms(samples: np.ndarray, frame: int = RATE_HZ // 100) -> np.ndarray:
    n = samples.size // frame
    return np.sqrt(np.mean(samples[: n * frame].reshape(n, frame) ** 2, axis=1)) if n else np.zeros(0)


def speech_onset_s(samples: np.ndarray) -> float:
    loud = np.flatnonzero(frame_rms(samples) > ONSET_RMS)
    return loud[0] / 100 if loud.size else 0.0


def trim(samples: np.ndarray) -> np.ndarray:
    loud = np.flatnonzero(frame_rms(samples) > ONSET_RMS)
    if not loud.size:
        return samples
    frame = RATE_HZ // 100
    return samples[loud[0] * frame : (loud[-1] + 1) * frame]


def padded(samples: np.ndarray, before_s: float = 0.4, after_s: float = 0.4) -> np.ndarray:
    return np.concatenate([np.zeros(int(before_s * RATE_HZ), np.float32), samples.astype(np.float32),
                           np.zeros(int(after_s * RATE_HZ), np.float32)])


def session_script(voices: Voices, session: int, turns: int, rng: random.Random) -> list[Line]:
    """The session's utterances: `turns` script turns cycling through KINDS."""
    names = voices.names()
    prompts = load_prompts()["dialogue"]
    lines: list[Line] = []

    def voice(t: int, offset: int = 0) -> str:
        return names[(session + t + offset) % len(names)]

    def question(t: int) -> str:  # alternate our own questions and the prompt set's
        pool = QUESTIONS if (session + t) % 2 == 0 else prompts
        return pool[(session * 3 + t) % len(pool)]

    for t in range(turns):
        kind, v = KINDS[t % len(KINDS)], voice(t)
        if kind == "follow-up":
            text = FOLLOW_UPS[(session + t) % len(FOLLOW_UPS)]
            lines.append(Line(kind, text, v, padded(voices.speak(text, v)), turn=t))
        elif kind == "pause":
            first, second = PAUSED[(session + t) % len(PAUSED)]
            silence_ms = rng.randrange(400, 601, 20)
            samples = np.concatenate([voices.speak(first, v), np.zeros(RATE_HZ * silence_ms // 1000, np.float32),
                                      voices.speak(second, v)])
            lines.append(Line(kind, f"{first} … {second}", v, padded(samples),
                              silence_ms=silence_ms, turn=t))
        else:
            text = question(t)
            lines.append(Line(kind, text, v, padded(voices.speak(text, v)), turn=t))
            if kind in ("interrupt", "backchannel"):
                words = INTERRUPTIONS if kind == "interrupt" else BACKCHANNELS
                over = words[(session + t) % len(words)]
                ov = voice(t, 1)
                lines.append(Line("barge-in" if kind == "interrupt" else "backchannel-word", over, ov,
                                  padded(voices.speak(over, ov), 0.1, 0.4), barge_in_after_s=BARGE_IN_AFTER_S,
                                  turn=t))
    return lines


def segments(lines: list[Line]) -> list[list[Line]]:
    """One Converse stream per script turn, a follow-up with the question before it.

    Each question that will be spoken over comes first in its stream: `converse_script` times
    `barge_in_after_s` on the loudspeaker's clock, which still holds the previous reply after
    it has played out, so a barge-in later in a stream would be said at once, before the reply
    it is meant to speak over has begun. And a stream with `wait_for_replies=True` whose
    script ends in a backchannel (no reply of its own) would wait for one until its deadline.
    """
    out: list[list[Line]] = []
    for line in lines:
        if not out or line.kind in KINDS and line.kind != "follow-up":
            out.append([])
        out[-1].append(line)
    return out


# ---- conversations ------------------------------------------------------------------------

async def run_session(address: str, session: int, sessions: int, lines: list[Line], api_key: str = "",
                      tls=None) -> list[Outcome]:
    """`api_key`, `tls`: what the gateway asks of a client (auth.api_key, tls.*; none by default)."""
    import grpc

    from services.channels import open_channel
    from services.client import ClientOptions, Say, converse_script, pb, pb_grpc

    await asyncio.sleep(session * SESSION_STAGGER_S)
    config = pb.SessionConfig(max_reply_tokens=MAX_REPLY_TOKENS)
    outcomes: list[Outcome] = []
    session_id = ""
    for segment in segments(lines):
        if not session_id or segment[0].turn % len(KINDS) == 0:  # each cycle of KINDS: a fresh session
            async with open_channel(address, secret=api_key, tls=tls) as channel:
                session_id = (await pb_grpc.GatewayStub(channel).CreateSession(
                    pb.CreateSessionRequest(config=config))).session_id
        ends_in_backchannel = segment[-1].kind == "backchannel-word"
        options = ClientOptions(chunk_ms=CHUNK_MS, wait_for_replies=not ends_in_backchannel,
                                trailing_silence_s=BACKCHANNEL_TAIL_S if ends_in_backchannel else 0.5,
                                session_id=session_id, api_key=api_key, tls=tls)
        says = [Say(float_to_pcm16(line.samples), barge_in_after_s=line.barge_in_after_s, label=line.kind)
                for line in segment]
        try:
            results = await asyncio.wait_for(converse_script(address, says, FMT, options), SEGMENT_TIMEOUT_S)
            note = ""
        except grpc.aio.AioRpcError as e:
            results, note = [], f"segment failed: {e.code().name}: {e.details()}"
        except TimeoutError:
            results, note = [], f"segment timed out ({SEGMENT_TIMEOUT_S:.0f} s)"
        if note:
            print(f"  session {session}: {note}", flush=True)
        outcomes += judge(segment, results, session, sessions, note)
    return outcomes


def judge(segment: list[Line], results: list, session: int, sessions: int, note: str) -> list[Outcome]:
    """Each script turn of a segment: its answered turns, pause latency, interruptions, cut-offs."""
    reported = [r for r in results if r.report]
    said_at = reported[0].report["said_at_s"] if reported else []
    started_ms = (reported[0].report["speech_end_unix_ms"] - reported[0].report["speech_end_s"] * 1000
                  if reported else None)

    def said_index(result) -> int:  # the utterance whose audio the turn's speech ended in
        end = result.report["speech_end_s"]
        return max((j for j, s in enumerate(said_at) if s <= end + 1e-6), default=-1)

    by_line: dict[int, list] = {}
    for r in reported:
        by_line.setdefault(said_index(r), []).append(r)
    outcomes: dict[int, Outcome] = {}
    for j, line in enumerate(segment):
        first = next(i for i, x in enumerate(segment) if x.turn == line.turn)
        o = outcomes.setdefault(line.turn, Outcome(session, line.turn, segment[first].kind, segment[first].voice,
                                                   " / ".join(x.text for x in segment if x.turn == line.turn),
                                                   note=note or ("nothing said: the stream failed"
                                                                 if not said_at else "")))
        answered = [r for r in by_line.get(j, []) if answered_turn(r.report)]
        o.rows += [row(r, line, session, sessions, j) for r in answered]
        if line.kind == "pause":
            o.cut_at_pause = any(not has_second_part(r.report["transcript"], line) for r in answered)
        if line.barge_in_after_s is not None and j < len(said_at) and started_ms is not None:
            onset_ms = started_ms + said_at[j] * 1000 + line.onset_ms
            over = [r for r in by_line.get(j - 1, []) if r.report["finish_reason"] != "cancelled"]
            pauses = [p for r in over for p in r.pauses_unix_ms if p >= onset_ms - 100]
            if not over:
                o.note = "no reply was playing when it was said"
            elif not pauses and all(reply_end_unix_ms(r) <= onset_ms for r in over):
                o.note = "the reply was over before it was said: not measured"
                o.reply_over = True
            else:
                o.pause_ms = round(min(pauses) - onset_ms) if pauses else None
                o.interrupted = any(r.report["finish_reason"] == "interrupted" or r.interrupt for r in over)
                if line.kind == "backchannel-word":
                    o.false_interruption = o.interrupted or bool(answered)  # it cut the reply, or became a turn
                if o.pause_ms is None:
                    o.note = "no pause"
        elif line.barge_in_after_s is not None:
            o.note = o.note or "barge-in never said (the reply did not play)"
    return list(outcomes.values())


def reply_end_unix_ms(result) -> float:
    """When the loudspeaker finished the reply, played from its first chunk (no pauses)."""
    if not result.first_audio_unix_ms:
        return float("inf")
    return result.first_audio_unix_ms + result.report["reply_audio_s"] * 1000


def words_of(text: str) -> set[str]:
    return {w.strip(".,!?;:'\"…").lower() for w in text.split()} - {""}


def has_second_part(transcript: str, line: Line) -> bool:
    """At least half the words after the pause are in the turn's transcript (the asr mishears
    some, "panders" for "pandas"; a turn cut at the pause has none of them)."""
    first, second = line.text.split(" … ")
    wanted = words_of(second) - words_of(first)
    return len(wanted & words_of(transcript)) >= len(wanted) / 2


def answered_turn(report: dict) -> bool:
    return report["finish_reason"] in ANSWERED and report["preemption"] != "dropped"


def row(result, line: Line, session: int, sessions: int, said_index: int) -> dict:
    report = result.report
    rel = {stage: t["ms_after_speech_end"] for stage, t in report["stages"].items()}

    def at(stage: str, name: str):
        return rel.get(stage, {}).get(name)

    if report.get("first_audio_sent_unix_ms"):
        gateway_audio = report["first_audio_sent_unix_ms"] - report["speech_end_unix_ms"]
    else:  # report_dict does not carry it: the gateway's first reply event sent (text or audio), which
        # waits for the turn's confirmation (end-of-turn score, or more silence)
        gateway_audio = at("gateway", "first_out")
    return {
        "sessions": sessions, "session": session, "session_id": report.get("session_id", ""),
        "turn": line.turn, "said_index": said_index, "kind": line.kind, "voice": line.voice, "said": line.text,
        "transcript": report["transcript"], "reply_text": report["reply_text"],
        "finish_reason": report["finish_reason"], "preemption": report["preemption"],
        "voice_to_voice_ms": report["voice_to_voice_ms"],
        "asr_final_ms": at("asr", "last_out"),
        "llm_first_token_ms": at("llm", "first_out"),
        "tts_first_audio_ms": at("tts", "first_out"),
        "gateway_first_sent_ms": gateway_audio,
        "budget_ms": report["budget_ms"], "budget_missed": report["budget_missed"],
        "degradations": report["degradations"],
        "pauses": report["pauses"], "resumes": report["resumes"], "interrupts": report["interrupts"],
        "cut_off": report["cut_off"], "heard_text": report["heard_text"],
        "reply_audio_s": report["reply_audio_s"], "prefix_cached_tokens": report["prefix_cached_tokens"],
        "end_of_turn_probability": report["end_of_turn_probability"], "end_of_turn_ms": report["end_of_turn_ms"],
        "stages": report["stages"],
    }


# ---- figures ------------------------------------------------------------------------------

STAGES = (("asr final", "asr_final_ms"), ("llm first token", "llm_first_token_ms"),
          ("tts first audio", "tts_first_audio_ms"), ("gateway first out", "gateway_first_sent_ms"),
          ("client first audio", "voice_to_voice_ms"))


def percentiles(values: list) -> dict:
    v = [x for x in values if x is not None]
    if not v:
        return {"n": 0, "p50": None, "p95": None, "p99": None}
    return {"n": len(v), "p50": round(float(statistics.median(v))),
            "p95": round(float(np.percentile(v, 95, method="nearest"))),
            "p99": round(float(np.percentile(v, 99, method="nearest")))}


def summarize(sessions: int, outcomes: list[Outcome], wall_s: float) -> dict:
    rows = [r for o in outcomes for r in o.rows]
    backchannels = [o for o in outcomes if o.kind == "backchannel" and not o.reply_over]
    interrupts = [o for o in outcomes if o.kind == "interrupt" and not o.reply_over]
    too_late = Counter(o.kind for o in outcomes if o.reply_over)
    paused = [o for o in outcomes if o.kind == "pause"]
    goals = dict(GOALS.get(str(sessions), {}))
    v2v = percentiles([r["voice_to_voice_ms"] for r in rows])
    pause = percentiles([o.pause_ms for o in backchannels + interrupts])
    degradations = Counter(d for r in rows for d in r["degradations"])
    return {
        "sessions": sessions,
        "wall_s": round(wall_s, 1),
        "script_turns": len(outcomes),
        "answered_turns": len(rows),
        "voice_to_voice_ms": v2v,
        "stages_ms_after_speech_end": {key: percentiles([r[key] for r in rows]) for _, key in STAGES},
        "pause_ms": pause | {"missing": sum(o.pause_ms is None for o in backchannels + interrupts)},
        "interruptions": {"said": len(interrupts), "interrupted": sum(bool(o.interrupted) for o in interrupts),
                          "after_the_reply_ended": too_late["interrupt"]},
        "backchannels": {"said": len(backchannels),
                         "false_interruptions": sum(bool(o.false_interruption) for o in backchannels),
                         "after_the_reply_ended": too_late["backchannel"]},
        "in_sentence_pauses": {"said": len(paused), "cut_off": sum(bool(o.cut_at_pause) for o in paused),
                               "unanswered": sum(not o.rows for o in paused)},
        "budget_missed": sum(bool(r["budget_missed"]) for r in rows),
        "degradations": dict(degradations.most_common()),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
        "replies_ending_in_cut_off_mark": sum(r["reply_text"].rstrip().endswith(CUT_OFF_MARK) for r in rows),
        "goals": goals | {"pause_p95": PAUSE_GOAL_P95_MS, "backchannel_false_interruptions": 0,
                          "in_sentence_cut_offs": 0},
        "met": _met(goals, v2v, pause, backchannels, paused),
        "script": [o.as_dict() for o in outcomes],
        "rows": rows,
    }


def _met(goals: dict, v2v: dict, pause: dict, backchannels, paused) -> dict:
    """Each goal: True, False, or None where nothing measured it."""
    met: dict[str, bool | None] = {f"voice_to_voice_{k}": None if v2v[k] is None else v2v[k] <= ms
                                   for k, ms in goals.items()}
    met["pause_p95"] = None if pause["p95"] is None else pause["p95"] <= PAUSE_GOAL_P95_MS
    met["backchannel_false_interruptions"] = (not any(o.false_interruption for o in backchannels)
                                              if backchannels else None)
    met["in_sentence_cut_offs"] = not any(o.cut_at_pause for o in paused) if paused else None
    return met


def print_table(results: dict) -> None:
    def fmt(v) -> str:
        return "-" if v is None else f"{v:.0f}"

    def ok(flag: bool | None) -> str:
        return "not measured" if flag is None else "ok" if flag else "MISSED"

    for key, s in results.items():
        g, met = s["goals"], s["met"]
        print(f"\n== {key} session{'s' if s['sessions'] > 1 else ''}: {s['answered_turns']} answered turns "
              f"of {s['script_turns']} script turns, {s['wall_s']:.0f} s ==")
        print(f"  {'ms after end of speech':<26} {'n':>4} {'p50':>6} {'p95':>6} {'p99':>6}   goal")
        for label, k in STAGES:
            p = s["stages_ms_after_speech_end"][k]
            goal = ""
            if k == "voice_to_voice_ms":
                goal = ", ".join(f"{q} ≤ {ms} {ok(met[f'voice_to_voice_{q}'])}" for q, ms in
                                 ((q, ms) for q, ms in g.items() if q in ("p50", "p95", "p99")))
            print(f"  {label:<26} {p['n']:>4} {fmt(p['p50']):>6} {fmt(p['p95']):>6} {fmt(p['p99']):>6}   {goal}")
        p = s["pause_ms"]
        print(f"  {'pause (onset → pause)':<26} {p['n']:>4} {fmt(p['p50']):>6} {fmt(p['p95']):>6} "
              f"{fmt(p['p99']):>6}   p95 ≤ {PAUSE_GOAL_P95_MS} {ok(met['pause_p95'])}"
              + (f"  ({p['missing']} barge-ins without a pause)" if p["missing"] else ""))
        b, c, i = s["backchannels"], s["in_sentence_pauses"], s["interruptions"]
        print(f"  backchannel false interruptions  {b['false_interruptions']}/{b['said']}   goal 0 "
              f"{ok(met['backchannel_false_interruptions'])}")
        print(f"  cut off at an in-sentence pause  {c['cut_off']}/{c['said']}   goal 0 "
              f"{ok(met['in_sentence_cut_offs'])}"
              + (f"  ({c['unanswered']} unanswered)" if c["unanswered"] else ""))
        print(f"  interruptions that interrupted   {i['interrupted']}/{i['said']}")
        late = i["after_the_reply_ended"] + b["after_the_reply_ended"]
        if late:
            print(f"  barge-ins after the reply ended  {late} (not measured)")
        print(f"  replies ending in the history's cut-off mark '{CUT_OFF_MARK}'  "
              f"{s['replies_ending_in_cut_off_mark']}/{s['answered_turns']}")
        print(f"  budget missed                    {s['budget_missed']}/{s['answered_turns']}")
        print("  degradations                     "
              + (", ".join(f"{n} ×{k}" for n, k in s["degradations"].items()) or "none"))
        print("  finish reasons                   " + ", ".join(f"{n} ×{k}" for n, k in s["finish_reasons"].items()))


def plot_waterfall(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.2), squeeze=False, sharex=True)
    labels = [label for label, _ in STAGES]
    for ax, s in zip(axes[0], results.values(), strict=True):
        medians = [s["stages_ms_after_speech_end"][k]["p50"] for _, k in STAGES]
        previous = 0.0
        for y, m in enumerate(medians):
            if m is None:
                continue
            ax.barh(y, m, color="#c9d6ea")  # from the end of speech
            start = max(previous, 0.0)
            if m > start:
                ax.barh(y, m - start, left=start, color="#3b6ea8")  # what this stage added
            ax.text(max(m, 0) + 15, y, f"{m:.0f}", va="center", fontsize=8)
            previous = max(previous, m)
        ax.axvline(800, color="#b04040", linewidth=0.8, linestyle="--", label="budget 800 ms")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        n = s["answered_turns"]
        ax.set_xlim(min(0, *(m for m in medians if m is not None)), 1.18 * max(900, *(m or 0 for m in medians)))
        ax.barh([], [], color="#3b6ea8", label="added over the stage above")
        ax.set(xlabel="median ms after the end of speech",
               title=f"{s['sessions']} session{'s' if s['sessions'] > 1 else ''} ({n} turns)")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the run ------------------------------------------------------------------------------

async def _run_sessions(address: str, scripts: list[list[Line]], settings) -> list[Outcome]:
    n = len(scripts)
    done = await asyncio.gather(*(run_session(address, i, n, lines, settings.auth.api_key, settings.tls)
                                  for i, lines in enumerate(scripts)))
    return [o for outcomes in done for o in outcomes]


def run(settings, session_counts: tuple[int, ...], turns: int, json_path: str | None, out_dir: str) -> int:
    from services.stack import running_stack

    work = Path(tempfile.mkdtemp(prefix="specvox-e2e-"))
    rng = random.Random(12)
    voices = Voices(settings)
    if not voices.espeak:
        print("espeak-ng is not on PATH: every session speaks with the bundled Piper voice only")
    print(f"making speech for {max(session_counts)} sessions × {turns} turns "
          f"({', '.join(voices.names())}) …", flush=True)
    scripts = [session_script(voices, i, turns, rng) for i in range(max(session_counts))]
    results: dict[str, dict] = {}
    with running_stack(work, host=settings.host) as stack:
        address, log = stack.addresses["gateway"], stack.log
        for n in session_counts:
            print(f"{n} session{'s' if n > 1 else ''} × {turns} turns …", flush=True)
            started = time.monotonic()
            outcomes = asyncio.run(_run_sessions(address, scripts[:n], settings))
            results[str(n)] = summarize(n, outcomes, time.monotonic() - started)
            s = results[str(n)]
            print(f"  {s['answered_turns']} answered turns in {s['wall_s']:.0f} s; "
                  f"voice to voice p50 {s['voice_to_voice_ms']['p50']} ms", flush=True)
    print(f"specvox up log: {log}")
    if not results:
        return 1
    print_table(results)
    if json_path:  # before the plot, so that a run is never lost to a missing plotting library
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    png = Path(out_dir) / "e2e_waterfall.png"
    try:
        plot_waterfall(results, png)
        print(f"wrote {png}")
    except ModuleNotFoundError as e:
        print(f"no waterfall plot: {e.name} is missing (pip install -e '.[bench]')")
    answered = sum(s["answered_turns"] for s in results.values())
    return 0 if answered else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", default="1,4", help="concurrent session counts to measure")
    parser.add_argument("--turns", type=int, default=8, help="each session's spoken turns")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/e2e.json",
                        help="write the rows here (default: %(default)s, the current figures)")
    parser.add_argument("--out", default="docs/benchmarks/results", help="folder for the waterfall PNG")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, tuple(int(n) for n in args.sessions.split(",")), args.turns, args.json_path, args.out)
