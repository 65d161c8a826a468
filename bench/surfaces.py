"""`specvox bench surfaces`: the same spoken turns through the native gRPC API and the OpenAI Realtime API.

What a client of either protocol feels, measured at the client in one run against one `specvox up`:
voice to voice (the end of speech in the input audio, as the script knows it, to the first reply
audio received) and pause latency (the onset of speech said over a playing reply to the server's
pause: the native `pause` event; on the Realtime API, the opt-in `specvox.playback.paused`, since a
strict client hears of speech over the reply only once it interrupts, as
`input_audio_buffer.speech_started`, whose latency is reported too). The goal: the Realtime path
within 10 % of native.

Each script turn is a question (bundled Piper voice or espeak-ng voices, as `bench e2e` speaks them)
and a barge-in said 1 s into its reply's playback, streamed in real time in 40 ms chunks; a fresh
session per turn on each surface, so both write the same replies from the same history. Turns
alternate which surface goes first, so that load on this shared machine falls on both alike.

- native: `services.client.converse_script`, the project's reference client, 16 kHz PCM;
- realtime: the `openai` SDK's `realtime.connect()` (a real client of the protocol, not ours), 24 kHz
  `audio/pcm`, playing the reply as it comes and sending `conversation.item.truncate` with the
  position heard when the server reports the barge-in, as OpenAI's own clients do.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import e2e
from pipeline.audio import PcmFormat, float_to_pcm16, resample

CHUNK_MS = 40
BARGE_IN_AFTER_S = 1.0
PAD_BEFORE_S, PAD_AFTER_S = 0.4, 0.4
BARGE_PAD_BEFORE_S = 0.1
MAX_REPLY_TOKENS = 48
REALTIME_RATE_HZ = 24_000
TURN_TIMEOUT_S = 90.0
GOAL_RATIO = 1.10  # the Realtime path within 10 % of native


@dataclass
class Turn:
    """One script turn: a question and the barge-in said over its reply."""

    question: str
    barge_in: str
    voice: str
    question_pcm: np.ndarray  # float32 at 16 kHz, trimmed
    barge_pcm: np.ndarray


@dataclass
class Measured:
    surface: str
    turn: int
    voice_to_voice_ms: list[float] = field(default_factory=list)  # the question's reply, then the barge-in's
    pause_ms: float | None = None
    interrupt_ms: float | None = None  # realtime: the barge-in's onset to speech_started
    note: str = ""


def script(settings, turns: int) -> list[Turn]:
    voices = e2e.Voices(settings)
    names = voices.names()
    out = []
    for t in range(turns):
        question = e2e.QUESTIONS[t % len(e2e.QUESTIONS)]
        barge = e2e.INTERRUPTIONS[t % len(e2e.INTERRUPTIONS)]
        voice, other = names[t % len(names)], names[(t + 1) % len(names)]
        out.append(Turn(question, barge, voice, voices.speak(question, voice), voices.speak(barge, other)))
    return out


# ---- native ---------------------------------------------------------------------------------

async def native_turn(address: str, turn: Turn, settings) -> Measured:
    from services.client import ClientOptions, Say, converse_script, pb

    m = Measured("native", 0)
    says = [Say(float_to_pcm16(e2e.padded(turn.question_pcm, PAD_BEFORE_S, PAD_AFTER_S))),
            Say(float_to_pcm16(e2e.padded(turn.barge_pcm, BARGE_PAD_BEFORE_S, PAD_AFTER_S)),
                barge_in_after_s=BARGE_IN_AFTER_S)]
    options = ClientOptions(chunk_ms=CHUNK_MS, wait_for_replies=True, trailing_silence_s=0.5,
                            config=pb.SessionConfig(max_reply_tokens=MAX_REPLY_TOKENS),
                            api_key=settings.auth.api_key, tls=settings.tls)
    results = await asyncio.wait_for(converse_script(address, says, PcmFormat(e2e.RATE_HZ, 1, 2), options),
                                     TURN_TIMEOUT_S)
    reported = [r for r in results if r.report]
    if not reported:
        m.note = "no turn reported"
        return m
    said_at = reported[0].report["said_at_s"]
    started_ms = reported[0].report["speech_end_unix_ms"] - reported[0].report["speech_end_s"] * 1000
    ends_s = [said_at[0] + PAD_BEFORE_S + turn.question_pcm.size / e2e.RATE_HZ,
              said_at[1] + BARGE_PAD_BEFORE_S + turn.barge_pcm.size / e2e.RATE_HZ] if len(said_at) > 1 else \
             [said_at[0] + PAD_BEFORE_S + turn.question_pcm.size / e2e.RATE_HZ]
    for result in sorted(reported, key=lambda r: r.report["speech_end_s"]):
        said = max((j for j, s in enumerate(said_at) if s <= result.report["speech_end_s"] + 1e-6), default=-1)
        if result.first_audio_unix_ms and 0 <= said < len(ends_s):
            m.voice_to_voice_ms.append(result.first_audio_unix_ms - (started_ms + ends_s[said] * 1000))
    if len(said_at) > 1:
        onset_ms = started_ms + (said_at[1] + BARGE_PAD_BEFORE_S) * 1000
        pauses = [p for r in reported for p in r.pauses_unix_ms if p >= onset_ms - 100]
        m.pause_ms = min(pauses) - onset_ms if pauses else None
        m.note = "" if pauses else "no pause"
    else:
        m.note = "the barge-in was never said"
    return m


# ---- OpenAI Realtime --------------------------------------------------------------------------

async def realtime_turn(http: str, turn: Turn, settings) -> Measured:
    """One connection (one session): the question, then the barge-in once 1 s of the reply has played."""
    from openai import AsyncOpenAI

    m = Measured("realtime", 0)
    client = AsyncOpenAI(base_url=f"http://{http}/v1", api_key=settings.auth.api_key or "specvox")
    chunk = REALTIME_RATE_HZ * CHUNK_MS // 1000
    question = _pcm24(e2e.padded(turn.question_pcm, PAD_BEFORE_S, PAD_AFTER_S))
    barge = _pcm24(e2e.padded(turn.barge_pcm, BARGE_PAD_BEFORE_S, PAD_AFTER_S))
    question_end_s = PAD_BEFORE_S + turn.question_pcm.size / e2e.RATE_HZ
    async with client.realtime.connect(model="specvox") as connection:
        await connection.send({"type": "session.update", "session": {
            "type": "realtime", "max_output_tokens": MAX_REPLY_TOKENS, "specvox": {"extension_events": True}}})
        t0 = time.time()
        sent = 0  # samples sent
        first_audio: dict[str, float] = {}  # response id -> when its first audio came
        played_from: dict[str, float] = {}
        barge_said_at_s: float | None = None  # input timeline
        speech_started: list[float] = []  # wall times
        paused: list[float] = []
        items: dict[str, str] = {}  # response id -> its audio item's id (what a truncate names)
        done: list[str] = []
        failure = ""

        async def microphone() -> None:
            nonlocal sent, barge_said_at_s
            pending = [question]
            speech = np.zeros(0, np.int16)
            while time.time() - t0 < TURN_TIMEOUT_S:
                if not speech.size and pending:
                    speech = pending.pop(0)
                elif not speech.size and barge_said_at_s is None and first_audio:
                    reply = next(iter(first_audio))
                    if time.time() - played_from[reply] >= BARGE_IN_AFTER_S:
                        barge_said_at_s = sent / REALTIME_RATE_HZ
                        speech = barge
                piece, speech = speech[:chunk], speech[chunk:]
                piece = np.concatenate([piece, np.zeros(chunk - piece.size, np.int16)])
                await connection.send({"type": "input_audio_buffer.append",
                                       "audio": base64.b64encode(piece.tobytes()).decode()})
                sent += chunk
                await asyncio.sleep(max(0.0, t0 + sent / REALTIME_RATE_HZ - time.time()))

        mic = asyncio.create_task(microphone())
        try:
            async with asyncio.timeout(TURN_TIMEOUT_S):
                async for event in connection:
                    kind = event.type
                    now = time.time()
                    if kind in ("response.output_audio.delta", "response.audio.delta"):
                        rid = event.response_id
                        if rid not in first_audio:
                            first_audio[rid] = now
                            played_from[rid] = now  # played as it comes: a loudspeaker from the first byte
                    elif kind == "specvox.playback.paused":
                        paused.append(now)
                    elif kind == "input_audio_buffer.speech_started":
                        speech_started.append(now)
                        playing = [r for r in first_audio if r not in done and r in items]
                        if playing and barge_said_at_s is not None:  # stop the loudspeaker; say what was heard
                            heard_ms = int((now - played_from[playing[0]]) * 1000)
                            await connection.send({"type": "conversation.item.truncate", "item_id": items[playing[0]],
                                                   "content_index": 0, "audio_end_ms": heard_ms})
                    elif kind == "response.output_item.added":
                        items[event.response_id] = event.item.id
                    elif kind == "response.done":
                        done.append(event.response.id)
                        if barge_said_at_s is not None and len([r for r in done if r in first_audio]) >= 2:
                            break
                    elif kind == "error":
                        failure = f"error event: {event.error.message}"
        except TimeoutError:
            failure = failure or f"timed out after {TURN_TIMEOUT_S:.0f} s"
        finally:
            mic.cancel()
    ends_s = [question_end_s] + ([barge_said_at_s + BARGE_PAD_BEFORE_S + turn.barge_pcm.size / e2e.RATE_HZ]
                                 if barge_said_at_s is not None else [])
    for end_s, started in zip(ends_s, first_audio.values(), strict=False):
        m.voice_to_voice_ms.append((started - (t0 + end_s)) * 1000)
    if barge_said_at_s is not None:
        onset = t0 + barge_said_at_s + BARGE_PAD_BEFORE_S
        heard = [s for s in speech_started if s >= onset - 0.1]
        m.interrupt_ms = (min(heard) - onset) * 1000 if heard else None
        pauses = [s for s in paused if s >= onset - 0.1]
        m.pause_ms = (min(pauses) - onset) * 1000 if pauses else None
    m.note = failure or ("" if m.pause_ms is not None else "no pause over the reply")
    return m


def _pcm24(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer(float_to_pcm16(resample(samples, e2e.RATE_HZ, REALTIME_RATE_HZ)), np.int16)


# ---- the run --------------------------------------------------------------------------------

def summarize(rows: list[Measured]) -> dict:
    out: dict = {}
    for surface in ("native", "realtime"):
        mine = [r for r in rows if r.surface == surface]
        out[surface] = {"voice_to_voice_ms": e2e.percentiles([v for r in mine for v in r.voice_to_voice_ms]),
                        "pause_ms": e2e.percentiles([r.pause_ms for r in mine]),
                        "interrupt_ms": e2e.percentiles([r.interrupt_ms for r in mine]),
                        "notes": [f"turn {r.turn}: {r.note}" for r in mine if r.note]}
    ratios = {}
    for figure in ("voice_to_voice_ms", "pause_ms"):
        for p in ("p50", "p95"):
            native, realtime = out["native"][figure][p], out["realtime"][figure][p]
            ratios[f"{figure}_{p}"] = round(realtime / native, 3) if native and realtime is not None else None
    out["realtime_over_native"] = ratios
    out["met_within_10_percent"] = {k: (None if v is None else v <= GOAL_RATIO) for k, v in ratios.items()}
    out["rows"] = [r.__dict__ for r in rows]
    return out


def print_table(results: dict) -> None:
    def fmt(v) -> str:
        return "-" if v is None else f"{v:.0f}"

    print(f"\n{'surface':<10} {'v2v p50':>8} {'v2v p95':>8} {'n':>3}   {'pause p50':>9} {'pause p95':>9} {'n':>3}")
    for surface in ("native", "realtime"):
        s = results[surface]
        v, p = s["voice_to_voice_ms"], s["pause_ms"]
        print(f"{surface:<10} {fmt(v['p50']):>8} {fmt(v['p95']):>8} {v['n']:>3}   "
              f"{fmt(p['p50']):>9} {fmt(p['p95']):>9} {p['n']:>3}")
    interrupt = results["realtime"]["interrupt_ms"]
    print(f"realtime: barge-in onset to input_audio_buffer.speech_started p50 {fmt(interrupt['p50'])}, "
          f"p95 {fmt(interrupt['p95'])} ms (n {interrupt['n']})")
    ratios = results["realtime_over_native"]
    print("realtime / native: " + ", ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in ratios.items()))
    for surface in ("native", "realtime"):
        for note in results[surface]["notes"]:
            print(f"  {surface}: {note}")


def run(settings, turns: int, json_path: str | None) -> int:
    from services.stack import running_stack

    try:
        import openai  # noqa: F401
    except ModuleNotFoundError:
        print("specvox bench surfaces needs the openai SDK: pip install -e '.[bench]'")
        return 2
    print(f"making speech for {turns} turns …", flush=True)
    turns_said = script(settings, turns)
    rows: list[Measured] = []
    with running_stack(Path(tempfile.mkdtemp(prefix="specvox-surfaces-")), host=settings.host) as stack:
        for t, turn in enumerate(turns_said):
            order = ("native", "realtime") if t % 2 == 0 else ("realtime", "native")
            for surface in order:
                if surface == "native":
                    m = asyncio.run(native_turn(stack.addresses["gateway"], turn, settings))
                else:
                    m = asyncio.run(realtime_turn(stack.http, turn, settings))
                m.turn = t
                rows.append(m)
                v2v = ", ".join(f"{v:.0f}" for v in m.voice_to_voice_ms) or "-"
                print(f"  turn {t} {surface:<8} v2v {v2v} ms, pause {_ms(m.pause_ms)} ms {m.note}", flush=True)
    results = summarize(rows)
    print_table(results)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return 0 if results["native"]["voice_to_voice_ms"]["n"] and results["realtime"]["voice_to_voice_ms"]["n"] else 1


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=8, help="script turns (each: a question and a barge-in)")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/surfaces.json",
                        help="write the figures here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.turns, args.json_path)

