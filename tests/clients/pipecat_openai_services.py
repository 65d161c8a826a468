"""One spoken turn through a Pipecat pipeline of Pipecat's own OpenAI services pointed at specvox.

Run in the clients' environment (`make clients`, requirements/clients.txt), not specvox's: Pipecat
pins its own dependencies. tests/e2e/test_openai_http.py runs it as a subprocess:

    python pipecat_openai_services.py --base-url http://HOST:PORT/v1 --wav question.wav --llm-model ID

The pipeline is the one a voice agent runs: audio frames → Silero VAD → `OpenAISTTService` (POST
/v1/audio/transcriptions) → the user's context aggregator → `OpenAILLMService` (streamed
/v1/chat/completions) → `OpenAITTSService` (/v1/audio/speech, pcm) → a sink that counts the audio.
The WAV (16 kHz mono 16-bit) is fed in 20 ms frames. Prints one JSON object: what the user said as
transcribed, the reply's text, the reply audio's bytes and rate, and any error frames.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import wave

from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMFullResponseEndFrame,
    LLMTextFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.openai.stt import OpenAISTTService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.workers.runner import WorkerRunner

FRAME_MS = 20


class Recorder(FrameProcessor):
    """Notes what passes: transcripts, the reply's text, its audio, errors; sets `done` when the audio ends."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.transcripts: list[str] = []
        self.reply: list[str] = []
        self.audio_bytes = 0
        self.sample_rates: set[int] = set()
        self.errors: list[str] = []
        self.llm_ended = asyncio.Event()
        self.done = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            self.transcripts.append(frame.text)
        elif isinstance(frame, LLMTextFrame):
            self.reply.append(frame.text)
        elif isinstance(frame, LLMFullResponseEndFrame):
            self.llm_ended.set()
        elif isinstance(frame, TTSAudioRawFrame):
            self.audio_bytes += len(frame.audio)
            self.sample_rates.add(frame.sample_rate)
        elif isinstance(frame, TTSStoppedFrame) and self.audio_bytes:
            self.done.set()
        elif isinstance(frame, ErrorFrame):
            self.errors.append(str(frame.error))
            self.done.set()
        await self.push_frame(frame, direction)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--wav", required=True)
    parser.add_argument("--llm-model", required=True)
    parser.add_argument("--api-key", default="sk-specvox")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()

    with wave.open(args.wav, "rb") as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    stt = OpenAISTTService(api_key=args.api_key, base_url=args.base_url,
                           settings=OpenAISTTService.Settings(model="whisper-1", language="en"))
    llm = OpenAILLMService(api_key=args.api_key, base_url=args.base_url,
                           settings=OpenAILLMService.Settings(
                               model=args.llm_model, temperature=0.0, max_completion_tokens=40,
                               system_instruction="You are a helpful assistant. Answer in one sentence."))
    tts = OpenAITTSService(api_key=args.api_key, base_url=args.base_url,
                           settings=OpenAITTSService.Settings(model="tts-1", voice="alloy"))
    context = LLMContext()
    aggregators = LLMContextAggregatorPair(context)
    heard, written, said = Recorder("heard"), Recorder("written"), Recorder("said")
    pipeline = Pipeline([VADProcessor(vad_analyzer=SileroVADAnalyzer()), stt, heard,
                         aggregators.user(), llm, written, tts, said, aggregators.assistant()])
    task = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=rate, audio_out_sample_rate=24_000))

    async def feed() -> None:
        step = rate * 2 * FRAME_MS // 1000
        silence = b"\0" * step
        for start in range(0, len(pcm), step):
            await task.queue_frame(InputAudioRawFrame(pcm[start:start + step].ljust(step, b"\0"), rate, 1))
            await asyncio.sleep(FRAME_MS / 1000 / 4)  # 4x real time: the VAD counts frames, not seconds
        for _ in range(1000 // FRAME_MS):  # a second of silence: the VAD hears the speech end
            await task.queue_frame(InputAudioRawFrame(silence, rate, 1))
            await asyncio.sleep(FRAME_MS / 1000 / 4)
        try:
            await asyncio.wait_for(said.done.wait(), args.timeout)
        finally:
            await task.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    await asyncio.gather(runner.run(), feed())
    print(json.dumps({"transcripts": heard.transcripts, "reply": "".join(written.reply).strip(),
                      "llm_ended": written.llm_ended.is_set(), "audio_bytes": said.audio_bytes,
                      "sample_rates": sorted(said.sample_rates), "errors": heard.errors + written.errors + said.errors,
                      "context": [m for m in context.get_messages() if isinstance(m, dict)]}))


if __name__ == "__main__":
    asyncio.run(main())
