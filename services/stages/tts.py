"""The tts stage: a queue worker taking turns from `sv:work:tts`, and the gRPC service (SpeakTurn,
Synthesize, SynthesizeStream, Capabilities). A turn's speech tails its token log and is written,
piece by piece, to the turn's speech stream (`sv:turn:{id}:speech`), where the gateway reads it;
a turn another worker left unfinished resumes at its first phrase not complete.

Synthesis runs in the model's worker thread one piece (a sentence of a phrase, or a
part of one) at a time, so a cancelled call (a barge-in) stops after the piece in hand
and nothing queued behind it is made or sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from pipeline.audio import float_to_pcm16
from pipeline.models import resolve_piper_voice
from pipeline.tts.backend import Synthesizer
from pipeline.tts.phrases import PhraseCutter, PhraseOptions
from pipeline.tts.speaker import ReplySpeaker, SpeechPiece
from pipeline.tts.synthesizers import load_synthesizer
from pipeline.tts.visemes import Viseme
from services.protos import load, load_common
from services.riva import tts as riva_tts
from services.server import logs, tracing
from services.server.errors import status_on_error, work_through_log
from services.server.model_worker import ModelWorker
from services.server.runtime import Service, service_main
from services.server.stage_clock import StageClock
from services.settings import Settings
from services.store.client import now_ms
from services.store.context import RedisContext, open_redis
from services.store.keys import speech_stream_key, turn_key
from services.store.turn_log import SpeechEntry, TurnLogWriter, finish_turn, read_speech_log, read_token_stream
from services.store.work_queue import WorkItem, WorkQueue, run_worker, work_request

log = logging.getLogger(__name__)
pb, pb_grpc = load("tts")
common = load_common()
AUDIO_CHUNK_S = 0.2  # audio goes out in pieces this long, so the client can start playing early
MAX_TEXT_CHARS = 100_000
MIN_SAMPLE_RATE_HZ, MAX_SAMPLE_RATE_HZ = 8_000, 48_000


class TtsServicer(pb_grpc.TtsServicer):
    def __init__(self, settings: Settings, synthesizer: Synthesizer, redis: RedisContext) -> None:
        self.settings = settings
        self.synthesizer = synthesizer
        self.redis = redis
        self.worker = ModelWorker("tts")
        self.voice = voice_name(settings)

    async def Capabilities(self, request, context: grpc.aio.ServicerContext):
        return pb.ServiceCapabilities(voices=[self.voice], default_voice=self.voice,
                                      sample_rate_hz=self.synthesizer.sample_rate_hz,
                                      backend=self.settings.tts.backend)

    def _check_voice(self, voice: str) -> None:
        if voice and voice != self.voice:
            raise ValueError(f"voice {voice!r} is not served here: choose {self.voice!r} (or leave it empty)")

    async def SpeakTurn(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """The turn's speech, standalone: what its speech stream holds already, then the rest (the
        code path of the queue's workers, `work`)."""
        async with status_on_error(context, "tts"):
            async for event in self._speak_turn(request, StageClock("tts"), replay=True):
                yield event

    async def work(self, draining: asyncio.Event) -> None:
        """The tts's queue worker: turns taken from `sv:work:tts` (services/store/work_queue.py) until the
        drain, several at once (they take the model thread in turns, piece by piece)."""
        settings = self.settings
        queue = WorkQueue(self.redis.client, "tts", settings.worker_name_of("tts"), settings.work)
        await run_worker(queue, self._work, max(1, settings.tts_concurrency), draining, self._dead)

    async def _work(self, item: WorkItem) -> None:
        """One turn from the queue; a request that can never succeed ends the turn's speech with its reason."""
        request = work_request(item, pb.SpeakTurnRequest)
        logs.bind(session_id=request.session_id, turn_id=request.turn_id)
        with tracing.work_span("tts", "tts Tts/SpeakTurn", item.fields, turn_id=request.turn_id, work_id=item.id):
            await work_through_log(
                self._speak_turn(request, StageClock("tts"), replay=False),
                lambda why: _end_speech(self.redis.client, request.turn_id, "error", why, self._done_ttl))

    async def _dead(self, item: WorkItem, letter: dict[str, str]) -> None:
        error = f"INTERNAL: tts gave up after {letter['deliveries']} tries: {letter['error']}"
        await _end_speech(self.redis.client, item.fields.get("turn", ""), "error", error, self._done_ttl)

    @property
    def _ttl(self) -> int:
        return self.settings.token_stream_ttl_s

    @property
    def _done_ttl(self) -> int:
        return self.settings.finished_turn_ttl_s

    async def _speak_turn(self, request, clock: StageClock, replay: bool) -> AsyncIterator:
        """The turn's speech events, each piece written to its speech stream before it is yielded.

        Tails the token log, cuts phrases and speaks each one as soon as it is complete. The writer
        claims the speech stream first (an earlier holder is fenced out). A stream another worker
        left unfinished is resumed: the phrases are cut again from the log the same way (the first
        phrase hurried at the same entry, as recorded), those complete are skipped, the first one
        not complete is said again from its recorded place in the timeline and numbering, and only
        its chunks and words not yet in the stream are written. `replay`: yield what the stream
        held too. A cancel (the gateway's key, or the log ending cancelled) stops within a piece.
        """
        turn_id = request.turn_id
        await self.redis.sessions.require(request.session_id)
        await self.redis.turns.require(turn_id, request.session_id)
        self._check_voice(request.voice)
        speaker = self._speaker(request.sample_rate_hz)
        writer = TurnLogWriter(self.redis.client, turn_id, "tts", speech_stream_key(turn_id), self._ttl)
        past = _Spoken(await read_speech_log(self.redis.client, turn_id) if await writer.claim() else [])
        if replay:
            for event in past.events():
                yield event
        if past.ended:
            return
        say = _Saying(self, writer, speaker, past, clock)
        cutter = PhraseCutter(self.settings.phrases)
        deadline_ms = request.budget.deadline_unix_ms
        hurry_at_ms = deadline_ms - self.settings.phrases.hurry_before_deadline_ms
        reason, error, ordinal = "done", "", 0
        try:
            async for entry in read_token_stream(self.redis.client, turn_id,
                                                 request.token_timeout_s or self.settings.token_timeout_s):
                clock.received()
                if entry.end and entry.finish_reason in ("cancelled", "error"):  # nothing more to say
                    reason, error = entry.finish_reason, entry.extra.get("error", "")
                    break
                if past.hurried_seq is not None:  # replay the first phrase's cut as it was made
                    if entry.seq == past.hurried_seq:
                        cutter.hurry()
                elif deadline_ms and now_ms() >= hurry_at_ms and cutter.hurry():  # the budget: a shorter first phrase
                    say.hurried_seq = entry.seq
                for text in cutter.feed(entry.text) + (cutter.flush() if entry.end else []):
                    async for event in say.phrase(ordinal, text):
                        yield event
                    ordinal += 1
        except _Cancelled:
            reason = "cancelled"
        times = common.StageTimes(**vars(clock), degradations=say.degradations)
        event = pb.SpeechEvent(times=times)
        await writer.append(*_numbered(writer, [
            SpeechEntry(0, "times", event=event.SerializeToString()),
            SpeechEntry(0, "end", data={"finish_reason": reason, **({"error": error} if error else {})})]))
        await finish_turn(self.redis.client, request.turn_id, self._done_ttl)
        yield event

    async def Synthesize(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("tts")
        clock.received()
        async with status_on_error(context, "tts"):
            if not request.text.strip():
                raise ValueError("text is empty")
            _check_length(len(request.text))
            self._check_voice(request.voice)
            speaker = self._speaker(request.sample_rate_hz)
            cutter = PhraseCutter(PhraseOptions(first_phrase_min_chars=1))
            async for event in self._speak(speaker, cutter.feed(request.text) + cutter.flush(), clock):
                yield event
            yield _documents(speaker)
            yield pb.SpeechEvent(times=clock.to_proto(common.StageTimes))

    async def SynthesizeStream(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """Text in pieces: each phrase is spoken as soon as it is complete, the rest at the end."""
        clock = StageClock("tts")
        async with status_on_error(context, "tts"):
            speaker: ReplySpeaker | None = None
            cutter = PhraseCutter(self.settings.phrases)
            chars, said_anything = 0, False
            async for piece in request_iterator:
                clock.received()
                speaker = speaker or self._speaker(piece.sample_rate_hz)
                chars += len(piece.text)
                said_anything = said_anything or bool(piece.text.strip())
                _check_length(chars)
                async for event in self._speak(speaker, cutter.feed(piece.text), clock):
                    yield event
            if speaker is None or not said_anything:
                raise ValueError("text is empty")
            async for event in self._speak(speaker, cutter.flush(), clock):
                yield event
            yield _documents(speaker)
            yield pb.SpeechEvent(times=clock.to_proto(common.StageTimes))

    def _speaker(self, sample_rate_hz: int) -> ReplySpeaker:
        if sample_rate_hz and not MIN_SAMPLE_RATE_HZ <= sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
            raise ValueError(f"sample_rate_hz {sample_rate_hz} is outside {MIN_SAMPLE_RATE_HZ}-{MAX_SAMPLE_RATE_HZ}")
        return ReplySpeaker(self.synthesizer, sample_rate_hz)

    async def _speak(self, speaker: ReplySpeaker, phrases: list[str], clock: StageClock) -> AsyncIterator:
        """The phrases' events, one synthesized piece at a time (a cancel lands between pieces)."""
        for text in phrases:
            async for piece in self.worker.iterate(speaker.speak(text)):
                for event in _events(piece, speaker):
                    if event.WhichOneof("event") == "audio":
                        clock.emitted()
                    yield event


class _Cancelled(Exception):  # noqa: N818 - a signal
    pass


class _Spoken:
    """What a turn's speech stream holds already: the phrases begun and finished (by their ordinal
    in the reply), every (kind, phrase, index) written, and whether the speech has ended."""

    def __init__(self, entries: list[SpeechEntry]) -> None:
        self.entries = entries
        self.keys = {e.key for e in entries}
        self.begun = {e.index: e for e in entries if e.kind == "phrase"}
        self.finished = {e.index: e for e in entries if e.kind == "done"}
        self.ended = any(e.kind == "end" for e in entries)
        first = self.begun.get(0)
        # None: no phrase was begun, the first one's cut is still to decide; -1: not hurried
        self.hurried_seq = int(first.data.get("hurried_seq", -1)) if first else None

    def events(self) -> list:
        return [pb.SpeechEvent.FromString(e.event) for e in self.entries if e.event]


class _Saying:
    """One turn's phrases, said and written to its speech stream (skipping what is there)."""

    def __init__(self, servicer: TtsServicer, writer: TurnLogWriter, speaker: ReplySpeaker, past: _Spoken,
                 clock: StageClock) -> None:
        self.servicer, self.writer, self.speaker, self.past, self.clock = servicer, writer, speaker, past, clock
        self.words = 0  # the turn's words so far: each word's index
        self.hurried_seq = -1
        self._played_from_s: float | None = None  # Unix time the turn's timeline starts playing, about
        hurried = past.hurried_seq is not None and past.hurried_seq >= 0
        self.degradations = ["first_phrase_shortened"] if hurried else []

    async def phrase(self, ordinal: int, text: str) -> AsyncIterator:
        speaker, past = self.speaker, self.past
        if done := past.finished.get(ordinal):  # said whole by an earlier worker: move past it
            speaker.resume_at(int(done.data["next_phrase"]), float(done.data["end_s"]), int(done.data["chunks"]))
            self.words = int(done.data["words"])
            return
        if begun := past.begun.get(ordinal):  # begun by an earlier worker: said again, only the rest written
            speaker.resume_at(begun.phrase, float(begun.data["start_s"]), int(begun.data["chunk"]))
            self.words = int(begun.data["word"])
        else:
            if ordinal == 0 and self.hurried_seq >= 0:
                self.degradations.append("first_phrase_shortened")
            marker = SpeechEntry(0, "phrase", speaker.next_phrase_index, ordinal, data={
                "text": text, "start_s": repr(speaker.end_s), "chunk": str(speaker.chunks_out),
                "word": str(self.words), **({"hurried_seq": str(self.hurried_seq)} if ordinal == 0 else {})})
            await self._write([marker])
        visemes = 0  # the phrase's visemes so far: each one's index (a phrase said again makes the same ones)
        async for piece in self.servicer.worker.iterate(speaker.speak(text), self._due_s):
            entries, fresh = [], []
            for event in _events(piece, speaker):
                kind = event.WhichOneof("event")
                index = event.audio.chunk_index if kind == "audio" else -1
                if kind == "word":
                    index, self.words = self.words, self.words + 1
                elif kind == "viseme":
                    index, visemes = visemes, visemes + 1
                entry = SpeechEntry(0, kind, piece.phrase_index, index, event.SerializeToString())
                if entry.key not in past.keys:
                    entries.append(entry)
                    fresh.append(event)
            if entries:
                await self._write(entries)
            for event in fresh:
                if event.WhichOneof("event") == "audio":
                    self.clock.emitted()
                    if self._played_from_s is None:
                        self._played_from_s = time.time() - event.audio.start_s
                yield event
        await self._write([SpeechEntry(0, "done", speaker.next_phrase_index - 1, ordinal, data={
            "end_s": repr(speaker.end_s), "chunks": str(speaker.chunks_out), "words": str(self.words),
            "next_phrase": str(speaker.next_phrase_index)})])

    def _due_s(self) -> float:
        """When the next piece will be played (the model thread's deadline for it): now, before
        the turn's first audio; after it, when playback from that audio reaches the end of what
        was made (the gateway sends audio a little ahead, `turn_taking.audio_lead_s`)."""
        if self._played_from_s is None:
            return time.time()
        return self._played_from_s + self.speaker.end_s

    async def _write(self, entries: list[SpeechEntry]) -> None:
        """One piece's entries, atomically; raises _Cancelled once the turn is cancelled."""
        if await self.writer.append(*_numbered(self.writer, entries)):
            raise _Cancelled


def _numbered(writer: TurnLogWriter, entries: list[SpeechEntry]) -> list[dict[str, str | int]]:
    return [dataclasses.replace(e, n=writer.next_seq + i).fields() for i, e in enumerate(entries)]


async def _end_speech(redis, turn_id: str, reason: str, error: str, done_ttl_s: int) -> None:
    """End a turn's speech stream that no worker will write any more (its request refused, given
    up): the turn is over, so its keys expire as a finished turn's do (`finish_turn`)."""
    n = int(await redis.hget(turn_key(turn_id), "tts_seq") or -1) + 1
    entry = SpeechEntry(n, "end", data={"finish_reason": reason, "error": error})
    await redis.xadd(speech_stream_key(turn_id), entry.fields())
    await finish_turn(redis, turn_id, done_ttl_s)


def voice_name(settings: Settings) -> str:
    """The name a client picks this service's voice by: the Piper voice file's, or the Coqui model's."""
    tts = settings.tts
    if tts.backend == "coqui":
        return tts.coqui_model
    return Path(resolve_piper_voice(tts.voice).model_path).stem


def _events(piece: SpeechPiece, speaker: ReplySpeaker) -> list:
    """Word cues first (they are known once the piece is made), then its audio, each chunk after the
    visemes that start in it, then the phrase cue."""
    events = [pb.SpeechEvent(word=_cue(c, piece.phrase_index)) for c in piece.word_cues]
    step = int(AUDIO_CHUNK_S * piece.sample_rate_hz)
    visemes = list(piece.visemes)
    for offset in range(0, piece.audio.size, step):
        chunk_end_s = piece.start_s + min(offset + step, piece.audio.size) / piece.sample_rate_hz
        starting = [v for v in visemes if v.start_s < chunk_end_s] if offset + step < piece.audio.size else visemes
        events += [pb.SpeechEvent(viseme=_viseme(v, piece.phrase_index)) for v in starting]
        visemes = visemes[len(starting) :]
        events.append(pb.SpeechEvent(audio=common.AudioChunk(
            pcm_s16le=float_to_pcm16(piece.audio[offset : offset + step]),
            sample_rate_hz=piece.sample_rate_hz,
            start_s=piece.start_s + offset / piece.sample_rate_hz,
            phrase_index=piece.phrase_index,
            chunk_index=speaker.chunks_out,
        )))
        speaker.chunks_out += 1
    events += [pb.SpeechEvent(viseme=_viseme(v, piece.phrase_index)) for v in visemes]  # a piece with no audio
    if piece.phrase_cue:
        events.append(pb.SpeechEvent(cue=_cue(piece.phrase_cue, piece.phrase_index)))
    return events


def _viseme(v: Viseme, phrase_index: int):
    return common.Viseme(start_s=v.start_s, end_s=v.end_s, id=v.viseme, azure_id=v.azure_id, weight=v.weight,
                         approximate=v.approximate, phrase_index=phrase_index)


def _cue(cue, phrase_index: int):
    return common.CaptionCue(start_s=cue.start_s, end_s=cue.end_s, text=cue.text, phrase_index=phrase_index)


def _documents(speaker: ReplySpeaker):
    return pb.SpeechEvent(captions=pb.CaptionDocuments(**speaker.captions.documents()))


def _check_length(chars: int) -> None:
    if chars > MAX_TEXT_CHARS:
        raise ValueError(f"text of {chars} characters exceeds {MAX_TEXT_CHARS}: split it over several calls")


async def build(settings: Settings) -> Service:
    """The tts service for run_service: the voice loaded and warmed before it serves."""
    redis = await open_redis(settings)
    synthesizer = load_synthesizer(settings.tts)
    synthesizer.warm_up()
    servicer = TtsServicer(settings, synthesizer, redis)

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_TtsServicer_to_server(servicer, server)
        riva_tts.add_to_server(servicer, server)  # Riva's synthesis calls, on the same synthesis

    return Service("tts", register, workers=[servicer.work], close=redis.close, more_names=[riva_tts.SERVICE_NAME])


if __name__ == "__main__":
    service_main(build)
