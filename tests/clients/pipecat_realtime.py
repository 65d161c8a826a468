"""Pipecat's `OpenAIRealtimeLLMService` pointed at specvox's Realtime API: two spoken turns, then a barge-in.

Run in the clients' environment (`make clients`, requirements/clients.txt), not specvox's: Pipecat pins
its own dependencies. tests/e2e/test_realtime.py runs it as a subprocess:

    python pipecat_realtime.py ws://HOST:PORT/v1/realtime first.pcm second.pcm barge_in.pcm

Each file is 24 kHz mono 16-bit PCM speech. The pipeline is Pipecat's own: audio frames in at
real-time pace (silence between the files, as a microphone), the realtime service with its server-side
turn detection (Pipecat's default), a sink for the reply audio. The first file is one turn, the second
asks for a long reply, and the third is said 1.5 s into that reply's audio: the server's speech_started
makes Pipecat interrupt and truncate the reply where it stopped playing. The service is subclassed only
to note what it receives (response.done statuses, session id, errors) and the truncates it sends.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from pipecat.frames.frames import EndFrame, Frame, InputAudioRawFrame, TranscriptionFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

RATE = 24_000
FRAME_MS = 20


class ObservedRealtimeService(OpenAIRealtimeLLMService):
    """Pipecat's service as it is, noting what it gets and sends."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session_id = ""
        self.responses: list[dict] = []
        self.errors: list[str] = []
        self.truncated: list[int] = []
        self.response_done = asyncio.Event()

    async def _handle_evt_session_created(self, evt) -> None:
        self.session_id = evt.session.id
        await super()._handle_evt_session_created(evt)

    async def _handle_evt_response_done(self, evt) -> None:
        details = evt.response.status_details or {}  # Pipecat's model keeps it as a dict
        reason = details.get("reason") if isinstance(details, dict) else getattr(details, "reason", None)
        self.responses.append({"status": evt.response.status, "reason": reason, "at": time.monotonic()})
        self.response_done.set()
        await super()._handle_evt_response_done(evt)

    async def _handle_evt_error(self, evt) -> None:
        self.errors.append(f"{evt.error.code}: {evt.error.message}")
        await super()._handle_evt_error(evt)

    async def send_client_event(self, event: events.ClientEvent) -> None:
        if isinstance(event, events.ConversationItemTruncateEvent):
            self.truncated.append(event.audio_end_ms)
        await super().send_client_event(event)


class Recorder(FrameProcessor):
    """The user's transcripts (they travel upstream) and the reply audio (downstream)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.transcripts: list[str] = []
        self.audio_bytes = 0
        self.first_audio_at: float | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            self.transcripts.append(frame.text)
        elif isinstance(frame, TTSAudioRawFrame):
            self.audio_bytes += len(frame.audio)
            self.first_audio_at = self.first_audio_at or time.monotonic()
        await self.push_frame(frame, direction)


class Microphone:
    """Speech when given, else silence, in 20 ms frames at real-time pace."""

    def __init__(self, task: PipelineWorker) -> None:
        self.task = task
        self.queue: list[bytes] = []
        self.idle = asyncio.Event()

    async def run(self) -> None:
        step = RATE * 2 * FRAME_MS // 1000
        start, sent = time.monotonic(), 0
        while True:
            if self.queue:
                piece, self.queue[0] = self.queue[0][:step], self.queue[0][step:]
                if not self.queue[0]:
                    self.queue.pop(0)
            else:
                piece = b""
                self.idle.set()
            await self.task.queue_frame(InputAudioRawFrame(piece.ljust(step, b"\0"), RATE, 1))
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * FRAME_MS / 1000 - time.monotonic()))

    def say(self, pcm: bytes) -> None:
        self.idle.clear()
        self.queue.append(pcm)


async def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the conversation did not get there in time")
        await asyncio.sleep(0.05)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("barge_in")
    parser.add_argument("--api-key", default="sk-specvox")
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args()
    speech = [open(path, "rb").read() for path in (args.first, args.second, args.barge_in)]

    llm = ObservedRealtimeService(api_key=args.api_key, base_url=args.url)
    upstream, downstream = Recorder("upstream"), Recorder("downstream")
    task = PipelineWorker(Pipeline([upstream, llm, downstream]),
                          params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE))
    mic = Microphone(task)
    outcome: dict = {}

    async def converse() -> None:
        feeder = asyncio.create_task(mic.run())
        try:
            await wait_for(lambda: llm.session_id, args.timeout)
            mic.say(speech[0])  # turn one
            await wait_for(lambda: len(llm.responses) >= 1, args.timeout)
            await asyncio.sleep(0.5)
            mic.say(speech[1])  # turn two: a long reply, spoken over 1.5 s into its audio
            audio_before = downstream.audio_bytes
            await wait_for(lambda: downstream.audio_bytes > audio_before, args.timeout)
            await asyncio.sleep(1.5)
            mic.say(speech[2])
            await wait_for(lambda: len(llm.responses) >= 3, args.timeout)
        except TimeoutError as e:
            outcome["timeout"] = str(e)
        finally:
            feeder.cancel()
            await task.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    await asyncio.gather(runner.run(), converse())
    print(json.dumps({"session_id": llm.session_id, "transcripts": upstream.transcripts,
                      "responses": [{k: r[k] for k in ("status", "reason")} for r in llm.responses],
                      "truncated": llm.truncated, "audio_bytes": downstream.audio_bytes,
                      "errors": llm.errors + ([outcome["timeout"]] if "timeout" in outcome else [])}))


if __name__ == "__main__":
    asyncio.run(main())
