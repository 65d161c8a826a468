"""The reference client: a live microphone and a loudspeaker on the gateway's Converse stream.

The microphone sends audio in real-time-sized chunks, each when a microphone would have
finished capturing it (silence between the user's utterances, as a live one does), so
`voice_to_voice_ms` (end of speech in the input → first reply audio received) is what a
person talking to the avatar would experience. The loudspeaker plays each reply in real
time from its first chunk, stops at a `pause`, plays on at a `resume`, drops the turn's
audio at an `interrupt`, and reports how far it has played (`Playback`), so the gateway's
history holds what was heard.

A conversation is a script of utterances (`Say`): each is spoken once the previous reply
has been heard (and a gap), or, to speak over the avatar, a set time into the reply's
playback.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.audio import PcmFormat, float_to_pcm16, read_wav, wav_bytes
from pipeline.captions import Cue, shown_cue, srt_document, webvtt_document
from pipeline.turn_taking import PlaybackClock
from services.channels import message_size_options, open_channel
from services.protos import load, load_common
from services.tls import TlsOptions

pb, pb_grpc = load("gateway")
common = load_common()
CONVERSATION_TIMEOUT_S = 180.0
# With wait_for_replies, the microphone closes once this long has passed with no turn under
# way, nothing playing and no speech: the end of speech, the final and an end-of-turn wait fit.
END_OF_CONVERSATION_SILENCE_S = 1.5


@dataclass
class ClientOptions:
    chunk_ms: int = 100
    realtime: bool = True
    trailing_silence_s: float = 1.0  # a live microphone keeps sending after the user stops
    # True: keep the microphone open (silence) until every reply has been played out, as a
    # person listening would; False: close after the trailing silence (the gateway then sends
    # what is left at once).
    wait_for_replies: bool = False
    report_every_ms: int = 100  # playback reports while a reply plays
    config: object | None = None  # a gateway SessionConfig for CreateSession
    overrides: object | None = None  # a SessionConfig for StreamStart.overrides
    session_id: str = ""  # converse in this session instead of creating one
    max_message_bytes: int = 4 * 1024 * 1024
    api_key: str = ""  # sent as `authorization: Bearer` (settings: auth.api_key)
    tls: TlsOptions | None = None  # None or no CA/certificate set: plaintext (settings: tls.*)


@dataclass
class Say:
    """One utterance of the script: 16-bit PCM in the conversation's input format."""

    pcm: bytes
    barge_in_after_s: float | None = None  # speak this far into the previous reply's playback
    gap_s: float = 0.6  # otherwise: this long after the previous reply was heard (or at once, first)
    label: str = ""


@dataclass
class TurnResult:
    turn_id: str = ""
    transcript: str = ""
    words: list[dict] = field(default_factory=list)
    speech_start_s: float = 0.0
    speech_end_s: float = 0.0
    reply_text: str = ""
    audio: list[tuple[float, bytes]] = field(default_factory=list)  # (start_s, pcm)
    # each audio chunk as it came: (phrase_index, chunk_index, Unix ms of arrival)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    sample_rate_hz: int = 0
    cues: list[Cue] = field(default_factory=list)  # one per phrase of the reply
    word_cues: list[Cue] = field(default_factory=list)  # one per word of the reply
    # each viseme as it came (a common.v1.Viseme), with how many audio chunks of the turn came before it
    visemes: list[tuple[int, Any]] = field(default_factory=list)
    visemes_after_interrupt: int = 0  # visemes received after the interrupt (none should come)
    first_audio_unix_ms: int = 0
    report: dict = field(default_factory=dict)
    utterance_index: int = -1
    user_cues: list[Cue] = field(default_factory=list)  # the user's words, in the input's timeline
    partials: list = field(default_factory=list)  # gateway Transcript messages before the final
    pauses_unix_ms: list[int] = field(default_factory=list)
    resumes: list[str] = field(default_factory=list)  # their reasons
    interrupt: dict = field(default_factory=dict)
    audio_after_interrupt: int = 0  # chunks received after the interrupt (none should come)
    caption: object | None = None  # caption mode: the utterance's cleaned Caption
    caption_unix_ms: int = 0  # caption mode: when it arrived
    provisional_captions: list = field(default_factory=list)  # the ASR's words as they came, before it
    played_s: float = 0.0  # how far the loudspeaker played

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


class Loudspeaker:
    """Plays one reply at a time in real time; the clock the gateway assumes, driven by events."""

    def __init__(self) -> None:
        self.turn_id = ""
        self.clock: PlaybackClock | None = None
        self.heard: dict[str, float] = {}  # turn → how far it played, once it is over
        self.dropped: set[str] = set()

    def received(self, turn_id: str, end_s: float, now_s: float) -> None:
        if turn_id in self.dropped:
            return
        if turn_id != self.turn_id:
            self._finish(now_s)
            self.turn_id, self.clock = turn_id, PlaybackClock(now_s)
        assert self.clock is not None
        self.clock.sent_until_s = max(self.clock.sent_until_s, end_s)

    def pause(self, turn_id: str, now_s: float) -> None:
        if self.clock and turn_id == self.turn_id:
            self.clock.pause(now_s)

    def resume(self, turn_id: str, now_s: float) -> None:
        if self.clock and turn_id == self.turn_id:
            self.clock.resume(now_s)

    def interrupt(self, turn_id: str, now_s: float) -> None:
        self.dropped.add(turn_id)
        if turn_id == self.turn_id:
            self._finish(now_s)

    def position(self, now_s: float) -> float:
        return self.clock.position(now_s) if self.clock else 0.0

    def playing(self, now_s: float) -> bool:
        c = self.clock
        return c is not None and (c.paused or c.position(now_s) < c.sent_until_s)

    def _finish(self, now_s: float) -> None:
        if self.clock:
            self.heard[self.turn_id] = self.clock.position(now_s)
        self.turn_id, self.clock = "", None


async def converse(address: str, wav_path: str, options: ClientOptions = ClientOptions()) -> list[TurnResult]:
    """Stream one WAV to the gateway as a microphone would; the turns it gave rise to."""
    pcm, fmt = read_wav(wav_path)
    return await converse_script(address, [Say(pcm)], fmt, options)


async def converse_script(address: str, script: list[Say], fmt: PcmFormat,
                          options: ClientOptions = ClientOptions()) -> list[TurnResult]:
    """Speak the script's utterances in one Converse stream, listening to the replies."""
    chunk_bytes = fmt.bytes_per_s * options.chunk_ms // 1000 // fmt.frame_bytes * fmt.frame_bytes
    speaker = Loudspeaker()
    turns: dict[str, TurnResult] = {}
    partials: list = []  # the user's words while they spoke (not part of any turn)
    said_at_s: list[float] = []  # where each utterance begins in the input
    answered_before: list[int] = [0]  # answered turns when each utterance began
    playing_at_say: set[str] = {""}  # the loudspeaker's turn whenever an utterance began (not its reply)
    t0 = time.monotonic()

    def now_s() -> float:
        return time.monotonic() - t0

    async with open_channel(address, secret=options.api_key, tls=options.tls,
                            options=message_size_options(options.max_message_bytes)) as channel:
        stub = pb_grpc.GatewayStub(channel)
        session_id = options.session_id or (await stub.CreateSession(pb.CreateSessionRequest(
            config=options.config or pb.SessionConfig()))).session_id
        ready = asyncio.Event()
        outgoing: asyncio.Queue = asyncio.Queue()
        started = 0.0

        def answered() -> int:
            return sum(bool(t.report) and t.report["finish_reason"] not in ("cancelled", "error")
                       for t in turns.values())

        def quiet() -> bool:
            """No turn under way (started, not reported) and nothing playing."""
            return not speaker.playing(now_s()) and not any(t.utterance_index >= 0 and not t.report
                                                            for t in turns.values())

        def due(say: Say, heard_since: float | None) -> bool:
            if not said_at_s:
                return True
            if say.barge_in_after_s is not None:  # speak over the reply to the last utterance, as it plays
                fresh = speaker.turn_id not in playing_at_say
                return fresh and speaker.clock is not None and speaker.position(now_s()) >= say.barge_in_after_s
            replied = answered() > answered_before[-1]  # the last utterance had its reply
            return replied and heard_since is not None and now_s() - heard_since >= say.gap_s

        async def microphone() -> None:
            nonlocal started
            await ready.wait()  # the gateway accepted session and format
            started = time.time()
            sent, i, pending = 0, 0, list(script)
            speech, quiet_since, heard_since = b"", 0.0, None
            silence_s = 0.0  # silence sent since the last speech, in the input's own time
            settle_s = max(options.trailing_silence_s, END_OF_CONVERSATION_SILENCE_S)
            deadline = now_s() + CONVERSATION_TIMEOUT_S
            while now_s() < deadline:
                heard = quiet()
                heard_since = (heard_since or now_s()) if heard else None
                if not speech and pending and due(pending[0], heard_since):
                    speech = pending.pop(0).pcm
                    said_at_s.append(sent / fmt.bytes_per_s)
                    answered_before.append(answered())
                    playing_at_say.add(speaker.turn_id)
                    heard_since = None
                if speech:
                    chunk, speech = speech[:chunk_bytes], speech[chunk_bytes:]
                    chunk += b"\0" * (chunk_bytes - len(chunk))
                    quiet_since, silence_s = (now_s() if not speech else quiet_since), 0.0
                else:
                    chunk = b"\0" * chunk_bytes
                    if not pending and silence_s >= options.trailing_silence_s:
                        if not options.wait_for_replies:
                            break
                        if heard_since is not None and now_s() - max(heard_since, quiet_since) >= settle_s:
                            break  # every reply heard, and nothing more came of the last words
                    silence_s += len(chunk) / fmt.bytes_per_s
                i += 1
                if options.realtime:
                    await asyncio.sleep(max(0.0, started + i * options.chunk_ms / 1000 - time.time()))
                elif not speech and silence_s > options.trailing_silence_s:
                    # Not real time: the speech and its trailing silence go out at once, but the
                    # silence while replies play or the next words wait stands for time passing.
                    await asyncio.sleep(options.chunk_ms / 1000)
                await outgoing.put(pb.ClientMessage(audio=chunk))
                sent += len(chunk)
            await outgoing.put(None)

        async def reports() -> None:
            while True:
                await asyncio.sleep(options.report_every_ms / 1000)
                if speaker.turn_id and speaker.clock and not speaker.clock.paused:
                    await outgoing.put(pb.ClientMessage(playback=pb.Playback(
                        turn_id=speaker.turn_id, played_until_s=speaker.position(now_s()))))

        async def messages():
            start = pb.StreamStart(session_id=session_id, format=common.AudioFormat(
                encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=fmt.sample_rate_hz,
                channels=fmt.channels, sample_width_bytes=2))
            if options.overrides is not None:
                start.overrides.CopyFrom(options.overrides)
            yield pb.ClientMessage(start=start)
            while (message := await outgoing.get()) is not None:
                yield message

        mic = asyncio.create_task(microphone())
        reporter = asyncio.create_task(reports())
        try:
            async for event in stub.Converse(messages()):
                kind = event.WhichOneof("event")
                if kind == "ready":
                    ready.set()
                    continue
                if kind == "transcript" and not event.transcript.is_final:
                    partials.append(event.transcript)
                    continue
                turn = turns.setdefault(event.turn_id, TurnResult(turn_id=event.turn_id))
                _record(turn, event, started, speaker, now_s())
        finally:
            mic.cancel()
            reporter.cancel()
        for turn in turns.values():
            turn.partials = [p for p in partials if p.utterance_index == turn.utterance_index]
            turn.played_s = speaker.heard.get(turn.turn_id, speaker.position(now_s())
                                              if speaker.turn_id == turn.turn_id else 0.0)
        results = list(turns.values())
        for result in results:
            if result.report:
                result.report |= {"session_id": session_id, "said_at_s": said_at_s}
        return results


def _record(turn: TurnResult, event, started_unix_s: float, speaker: Loudspeaker, now_s: float) -> None:
    kind = event.WhichOneof("event")
    if kind == "transcript":
        t = event.transcript
        turn.transcript, turn.speech_start_s, turn.speech_end_s = t.text, t.speech_start_s, t.speech_end_s
        turn.words = [{"text": w.text, "start_s": w.start_s, "end_s": w.end_s} for w in t.words]
        turn.utterance_index = t.utterance_index
        turn.user_cues = [shown_cue(c.start_s, c.end_s, c.text) for c in t.cues]
    elif kind == "reply_text":
        turn.reply_text += event.reply_text.text_delta
    elif kind == "audio":
        if turn.interrupt:
            turn.audio_after_interrupt += 1
            return
        if not turn.first_audio_unix_ms:
            turn.first_audio_unix_ms = int(time.time() * 1000)
        a = event.audio
        turn.sample_rate_hz = a.sample_rate_hz
        turn.audio.append((a.start_s, a.pcm_s16le))
        turn.chunks.append((a.phrase_index, a.chunk_index, int(time.time() * 1000)))
        speaker.received(turn.turn_id, a.start_s + len(a.pcm_s16le) / 2 / a.sample_rate_hz, now_s)
    elif kind == "cue":
        turn.cues.append(Cue(event.cue.start_s, event.cue.end_s, event.cue.text))
    elif kind == "word":
        turn.word_cues.append(Cue(event.word.start_s, event.word.end_s, event.word.text))
    elif kind == "viseme":
        if turn.interrupt:
            turn.visemes_after_interrupt += 1
        else:
            turn.visemes.append((len(turn.audio), event.viseme))
    elif kind == "pause":
        turn.pauses_unix_ms.append(int(time.time() * 1000))
        speaker.pause(turn.turn_id, now_s)
    elif kind == "resume":
        turn.resumes.append(event.resume.reason)
        speaker.resume(turn.turn_id, now_s)
    elif kind == "interrupt":
        turn.interrupt = {"heard_until_s": event.interrupt.heard_until_s, "heard_text": event.interrupt.heard_text,
                          "unix_ms": int(time.time() * 1000)}
        speaker.interrupt(turn.turn_id, now_s)
    elif kind == "caption":
        if event.caption.provisional:
            turn.provisional_captions.append(event.caption)
        else:
            turn.caption, turn.caption_unix_ms = event.caption, int(time.time() * 1000)
    elif kind == "report":
        turn.report = report_dict(turn, event.report, started_unix_s)


def report_dict(turn: TurnResult, report, started_unix_s: float) -> dict:
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
        "heard_text": report.heard_text,
        "cut_off": report.cut_off,
        "finish_reason": report.finish_reason,
        "preemption": report.preemption,
        "speech_end_s": round(report.speech_end_s, 3),
        "speech_end_unix_ms": round(speech_end_ms),
        "first_audio_sent_unix_ms": report.first_audio_sent_unix_ms,
        "voice_to_voice_ms": round(turn.first_audio_unix_ms - speech_end_ms) if turn.first_audio_unix_ms else None,
        "budget_ms": report.budget_ms,
        "budget_missed": report.budget_missed,
        "degradations": [f"{d.stage}:{d.name}" for d in report.degradations],
        "pauses": report.pauses,
        "resumes": report.resumes,
        "interrupts": report.interrupts,
        "end_of_turn_probability": round(report.end_of_turn_probability, 4),
        "end_of_turn_ms": report.end_of_turn_ms,
        "prefix_cached_tokens": report.prefix_cached_tokens,
        "mode": report.mode,
        "reply_audio_s": round(audio_s, 3),
        "stages": stages,
    }


def write_outputs(turns: list[TurnResult], out_dir: str) -> dict:
    """reply.wav, captions.vtt (and .srt), word_captions.vtt, user_captions.vtt, visemes.json and
    report.json for the conversation's last complete turn."""
    done = [t for t in turns if t.report and t.report["finish_reason"] not in ("cancelled", "interrupted")]
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
    visemes = [{"start_s": v.start_s, "end_s": v.end_s, "id": v.id, "azure_id": v.azure_id,
                "weight": round(v.weight, 3), "approximate": v.approximate} for _, v in turn.visemes]
    (out / "visemes.json").write_text(json.dumps(visemes, indent=1) + "\n")
    (out / "report.json").write_text(json.dumps(turn.report, indent=2) + "\n")
    return turn.report


# -- a file's captions through the gateway -------------------------------------------------

FILE_SAMPLE_RATE_HZ = 16_000  # a file's audio goes out as 16 kHz mono s16le, decoded here (pipeline/media.py)
FAST_CHUNK_S = 1.0  # not real time: audio a message
# Not real time, the client holds back while this many caption turns are under way ...
CAPTIONS_IN_FLIGHT = 8
# ... or while it has sent this much audio past the end of the last speech the asr has transcribed ...
AUDIO_LEAD_S = 30.0
# ... unless nothing has come back for this long with no caption under way (the asr is in a long
# silence: its audio has no transcripts to show for it), which lets another AUDIO_LEAD_S go out.
STALL_S = 1.0


@dataclass
class GatewayCaptions:
    """What a caption session made of a file: each utterance's `Caption`, in the input's order."""

    session_id: str = ""
    captions: list = field(default_factory=list)  # gateway Caption messages
    transcripts: list[str] = field(default_factory=list)  # the transcript each caption was made from
    failed: list[dict] = field(default_factory=list)  # reports of caption turns that gave no caption
    audio_s: float = 0.0  # of audio sent
    sent_s: float = 0.0  # wall time until the last audio was sent
    first_caption_s: float = 0.0  # until the first caption came
    total_s: float = 0.0  # until the last caption came

    def lines(self) -> list[Cue]:
        """The broadcast cues of every utterance, line for line as the gateway laid them out, on the file's timeline."""
        return [shown_cue(c.start_s, c.end_s, c.text, k)
                for k, caption in enumerate(self.captions) for c in caption.lines]

    def documents(self) -> dict[str, str]:
        """captions.vtt, captions.srt and captions.json (each caption's text and word times) by file name."""
        words = [{"transcript": transcript, "text": caption.text,
                  "words": [{"text": c.text, "start": round(c.start_s, 3), "end": round(c.end_s, 3)}
                            for c in caption.cues]}
                 for transcript, caption in zip(self.transcripts, self.captions, strict=True)]
        return {"captions.vtt": webvtt_document(self.lines()), "captions.srt": srt_document(self.lines()),
                "captions.json": json.dumps({"session_id": self.session_id, "captions": words,
                                             "cues": [{"start": c.start_s, "end": c.end_s, "text": c.text}
                                                      for c in self.lines()]}, indent=1) + "\n"}


class CaptionFlow:
    """How far a file sent unpaced may run ahead of its captions.

    The gateway takes audio as fast as it comes (the asr stage reads it into a queue of its own, not
    bounded), and each final transcript starts a caption turn at once: a 10-minute file sent unpaced
    gave ~170 caption turns at the same time, and the gateway failed the stream (UNAVAILABLE: its Redis
    client's pool of 100 connections ran out, one held by each turn reading its token log). So the
    client keeps at most `CAPTIONS_IN_FLIGHT` caption turns under way and at most `AUDIO_LEAD_S` of
    audio beyond what the asr has shown it has transcribed: as fast as the stack captions, no faster.
    """

    def __init__(self) -> None:
        self.turns: set[str] = set()  # caption turns under way (their final came, their report not yet)
        self.heard_s = 0.0  # the end of the last speech transcribed (partials and finals), input timeline
        self._changed = asyncio.Event()

    def seen(self, event) -> None:
        kind = event.WhichOneof("event")
        if kind == "transcript":
            self.heard_s = max(self.heard_s, event.transcript.speech_end_s)
            if event.transcript.is_final and event.turn_id and event.transcript.text.strip():
                self.turns.add(event.turn_id)  # an empty final starts no caption turn
        elif kind == "report":
            self.turns.discard(event.turn_id)
        self._changed.set()

    async def room(self, sent_s: float) -> None:
        """Until there is room for more audio after `sent_s` seconds of it."""
        while len(self.turns) >= CAPTIONS_IN_FLIGHT or sent_s - self.heard_s >= AUDIO_LEAD_S:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), STALL_S)
            except TimeoutError:
                if not self.turns:  # silence at the asr: nothing to show for the audio sent
                    self.heard_s = sent_s


async def caption_file(address: str, path: str, options: ClientOptions = ClientOptions(),
                       max_duration_s: float | None = None) -> GatewayCaptions:
    """A media file (any kind `specvox captions` takes) streamed to the gateway in caption mode.

    `options.realtime`: audio goes out as a microphone would send it, `chunk_ms` at a time; False
    (`specvox client --caption --no-realtime`): as fast as the gateway takes it, a second of audio a
    message, as gRPC's flow control lets them through. The gateway neither paces nor refuses fast audio:
    it forwards each message to the asr's stream as it comes (its arrival clock only records when),
    and a caption turn starts at each final transcript as in real time; so the client itself holds
    back while enough captions are under way (`CaptionFlow`). The file is decoded as it is sent, so
    an hour of it is never in memory at once.
    """
    from pipeline.media import DEFAULT_MAX_DURATION_S, MediaAudio

    config = pb.SessionConfig()
    if options.config is not None:
        config.CopyFrom(options.config)
    config.mode = pb.SessionConfig.CAPTION
    result = GatewayCaptions()
    by_turn: dict[str, object] = {}  # turn -> its Caption
    finals: dict[str, str] = {}  # turn -> its transcript
    flow = CaptionFlow()
    t0 = time.monotonic()
    with MediaAudio(path, DEFAULT_MAX_DURATION_S if max_duration_s is None else max_duration_s) as media:
        async with open_channel(address, secret=options.api_key, tls=options.tls,
                                options=message_size_options(options.max_message_bytes)) as channel:
            stub = pb_grpc.GatewayStub(channel)
            session_id = options.session_id or (await stub.CreateSession(
                pb.CreateSessionRequest(config=config))).session_id
            result.session_id = session_id
            ready = asyncio.Event()

            async def messages():
                start = pb.StreamStart(session_id=session_id, format=common.AudioFormat(
                    encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=FILE_SAMPLE_RATE_HZ, channels=1,
                    sample_width_bytes=2))
                if options.overrides is not None:
                    start.overrides.CopyFrom(options.overrides)
                yield pb.ClientMessage(start=start)
                await ready.wait()
                step = round((options.chunk_ms / 1000 if options.realtime else FAST_CHUNK_S) * FILE_SAMPLE_RATE_HZ)
                started, sent = time.monotonic(), 0
                for chunk in media.chunks():
                    for i in range(0, chunk.size, step):
                        piece = chunk[i : i + step]
                        if options.realtime:
                            await asyncio.sleep(max(0.0, started + sent / FILE_SAMPLE_RATE_HZ - time.monotonic()))
                        else:
                            await flow.room(sent / FILE_SAMPLE_RATE_HZ)
                        yield pb.ClientMessage(audio=float_to_pcm16(piece))
                        sent += piece.size
                result.audio_s, result.sent_s = sent / FILE_SAMPLE_RATE_HZ, time.monotonic() - t0

            async for event in stub.Converse(messages()):
                flow.seen(event)
                kind = event.WhichOneof("event")
                if kind == "ready":
                    ready.set()
                elif kind == "transcript" and event.transcript.is_final:
                    finals[event.turn_id] = event.transcript.text
                elif kind == "caption" and not event.caption.provisional:  # provisional: words while spoken
                    by_turn[event.turn_id] = event.caption
                    result.first_caption_s = result.first_caption_s or time.monotonic() - t0
                elif kind == "report" and event.turn_id not in by_turn:
                    result.failed.append({"turn_id": event.turn_id, "finish_reason": event.report.finish_reason,
                                          "transcript": event.report.transcript})
    turns = sorted(by_turn, key=lambda t: by_turn[t].cues[0].start_s if by_turn[t].cues else 0.0)  # type: ignore
    result.captions = [by_turn[t] for t in turns]
    result.transcripts = [finals.get(t, "") for t in turns]
    result.total_s = time.monotonic() - t0
    return result
