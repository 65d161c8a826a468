"""The reference client: streams a WAV to the gateway like a live microphone and records the reply.

Audio is sent in real-time-sized chunks, each when a microphone would have finished
capturing it, so `voice_to_voice_ms` (end of speech in the input → first reply audio
sample received) is what a person talking to the avatar would experience.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from pipeline.audio import read_wav, wav_bytes
from pipeline.captions import Cue, srt_document, webvtt_document
from services.grpc_server import message_options
from services.protos import load

pb, pb_grpc = load("gateway")


@dataclass
class ClientOptions:
    chunk_ms: int = 100
    realtime: bool = True
    trailing_silence_s: float = 1.0  # a live microphone keeps sending after the user stops
    reply_sample_rate_hz: int = 0
    max_message_bytes: int = 4 * 1024 * 1024


@dataclass
class TurnResult:
    turn_id: str = ""
    transcript: str = ""
    words: list[dict] = field(default_factory=list)
    speech_end_s: float = 0.0
    reply_text: str = ""
    audio: list[tuple[float, bytes]] = field(default_factory=list)  # (start_s, pcm)
    sample_rate_hz: int = 0
    cues: list[Cue] = field(default_factory=list)  # one per phrase of the reply
    word_cues: list[Cue] = field(default_factory=list)  # one per word of the reply
    first_audio_unix_ms: int = 0
    report: dict = field(default_factory=dict)
    utterance_index: int = -1
    user_cues: list[Cue] = field(default_factory=list)  # the user's words, in the input's timeline
    partials: list = field(default_factory=list)  # gateway Transcript messages before the final

    def reply_pcm(self) -> bytes:
        """The reply's audio laid out on its timeline."""
        if not self.audio:
            return b""
        end = max(start + len(pcm) / 2 / self.sample_rate_hz for start, pcm in self.audio)
        out = np.zeros(int(round(end * self.sample_rate_hz)), "<i2")
        for start, pcm in self.audio:
            samples = np.frombuffer(pcm, "<i2")
            i = int(round(start * self.sample_rate_hz))
            out[i : i + samples.size] = samples[: out.size - i]
        return out.tobytes()


async def converse(address: str, wav_path: str, options: ClientOptions = ClientOptions()) -> list[TurnResult]:
    pcm, fmt = read_wav(wav_path)
    pcm += b"\0" * (int(options.trailing_silence_s * fmt.sample_rate_hz) * fmt.frame_bytes)
    chunk_bytes = fmt.bytes_per_s * options.chunk_ms // 1000
    async with grpc.aio.insecure_channel(address, options=message_options(options.max_message_bytes)) as channel:
        stub = pb_grpc.GatewayStub(channel)
        session = await stub.CreateSession(pb.CreateSessionRequest())
        ready = asyncio.Event()
        started = 0.0

        async def messages():
            nonlocal started
            yield pb.ClientMessage(start=pb.StreamStart(
                session_id=session.session_id,
                format=pb.AudioFormat(encoding=pb.AudioFormat.PCM_S16LE, sample_rate_hz=fmt.sample_rate_hz,
                                      channels=fmt.channels, sample_width_bytes=2),
                reply_sample_rate_hz=options.reply_sample_rate_hz))
            await ready.wait()  # the gateway accepted session and format
            started = time.time()
            for i, offset in enumerate(range(0, len(pcm), chunk_bytes)):
                if options.realtime:
                    await asyncio.sleep(max(0.0, started + (i + 1) * options.chunk_ms / 1000 - time.time()))
                yield pb.ClientMessage(audio=pcm[offset : offset + chunk_bytes])

        turns: dict[str, TurnResult] = {}
        partials: list = []  # the user's words while they spoke (not part of any turn)
        async for event in stub.Converse(messages()):
            if event.WhichOneof("event") == "ready":
                ready.set()
                continue
            if event.WhichOneof("event") == "transcript" and not event.transcript.is_final:
                partials.append(event.transcript)
                continue
            turn = turns.setdefault(event.turn_id, TurnResult(turn_id=event.turn_id))
            _record(turn, event, started)
        results = list(turns.values())
        for turn in results:
            turn.partials = [p for p in partials if p.utterance_index == turn.utterance_index]
        return results


def _record(turn: TurnResult, event: pb.ServerEvent, started_unix_s: float) -> None:
    kind = event.WhichOneof("event")
    if kind == "transcript":
        t = event.transcript
        turn.transcript, turn.speech_end_s = t.text, t.speech_end_s
        turn.words = [{"text": w.text, "start_s": w.start_s, "end_s": w.end_s} for w in t.words]
        turn.utterance_index = t.utterance_index
        turn.user_cues = [Cue(c.start_s, c.end_s, c.text) for c in t.cues]
    elif kind == "reply_text":
        turn.reply_text += event.reply_text.text_delta
    elif kind == "audio":
        if not turn.first_audio_unix_ms:
            turn.first_audio_unix_ms = int(time.time() * 1000)
        turn.sample_rate_hz = event.audio.sample_rate_hz
        turn.audio.append((event.audio.start_s, event.audio.pcm_s16le))
    elif kind == "cue":
        turn.cues.append(Cue(event.cue.start_s, event.cue.end_s, event.cue.text))
    elif kind == "word":
        turn.word_cues.append(Cue(event.word.start_s, event.word.end_s, event.word.text))
    elif kind == "report":
        turn.report = report_dict(turn, event.report, started_unix_s)


def report_dict(turn: TurnResult, report: pb.TurnReport, started_unix_s: float) -> dict:
    """The turn's report; times are Unix ms and, under `_ms_after_speech_end`, relative."""
    speech_end_ms = started_unix_s * 1000 + report.speech_end_s * 1000
    stages = {}
    for s in report.stages:
        stages[s.stage] = {
            name: getattr(s, name)
            for name in ("first_in_unix_ms", "last_in_unix_ms", "first_out_unix_ms", "last_out_unix_ms")
        }
        stages[s.stage]["ms_after_speech_end"] = {
            name.removesuffix("_unix_ms"): round(value - speech_end_ms) if value else None
            for name, value in list(stages[s.stage].items())
        }
    audio_s = len(turn.reply_pcm()) / 2 / turn.sample_rate_hz if turn.sample_rate_hz else 0.0
    return {
        "turn_id": turn.turn_id,
        "transcript": report.transcript,
        "reply_text": report.reply_text,
        "finish_reason": report.finish_reason,
        "preemption": report.preemption,
        "speech_end_s": round(report.speech_end_s, 3),
        "voice_to_voice_ms": round(turn.first_audio_unix_ms - speech_end_ms) if turn.first_audio_unix_ms else None,
        "budget_ms": report.budget_ms,
        "reply_audio_s": round(audio_s, 3),
        "stages": stages,
    }


def write_outputs(turns: list[TurnResult], out_dir: str) -> dict:
    """reply.wav, captions.vtt (and .srt), word_captions.vtt, user_captions.vtt and report.json
    for the conversation's last complete turn."""
    done = [t for t in turns if t.report]
    if not done:
        raise RuntimeError("the gateway finished no turn: was there speech in the audio?")
    turn = done[-1]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reply.wav").write_bytes(wav_bytes(turn.reply_pcm(), turn.sample_rate_hz))
    (out / "captions.vtt").write_text(webvtt_document(turn.cues))
    (out / "captions.srt").write_text(srt_document(turn.cues))
    (out / "word_captions.vtt").write_text(webvtt_document(turn.word_cues))
    (out / "user_captions.vtt").write_text(webvtt_document(turn.user_cues))
    (out / "report.json").write_text(json.dumps(turn.report, indent=2) + "\n")
    return turn.report
