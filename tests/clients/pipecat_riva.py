"""Pipecat's NVIDIA services (pipecat-ai[nvidia]) pointed at specvox's Riva surfaces, run in .venv-clients
(requirements/clients.txt) by tests/e2e/test_riva_pipecat.py; prints one JSON object on stdout.

Two Pipecat pipelines, as a voice agent builds them, with `use_ssl=False` (a local server):
- [NvidiaSTTService → collector]: a WAV file's audio pushed as InputAudioRawFrames at the speed of
  speech (20 ms frames), then silence until a final TranscriptionFrame arrives;
- [NvidiaTTSService → collector]: a TTSSpeakFrame, its TTSAudioRawFrames collected until TTSStoppedFrame.

Output: {"transcript", "interim_count", "stt_errors", "tts_audio_bytes", "tts_sample_rate",
"tts_frames", "tts_errors"}. No specvox import: this environment holds the client alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import wave

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.nvidia.stt import NvidiaSTTService
from pipecat.services.nvidia.tts import NvidiaTTSService
from pipecat.workers.runner import WorkerRunner

FRAME_MS = 20
TIMEOUT_S = 60.0


class Collector(FrameProcessor):
    """The frames that reach the end of the pipeline; `done` is set by the one the run waits for."""

    def __init__(self, until: type[Frame]) -> None:
        super().__init__()
        self.frames: list[Frame] = []
        self.until = until
        self.done = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.frames.append(frame)
        if isinstance(frame, self.until):
            self.done.set()
        await self.push_frame(frame, direction)


async def run(task: PipelineWorker, collector: Collector, feed) -> None:
    """Run the pipeline, feed it, wait for the collector's frame, end it."""
    runner = WorkerRunner(handle_sigint=False)
    running = asyncio.create_task(runner.run(task))
    try:
        await feed()
        await asyncio.wait_for(collector.done.wait(), TIMEOUT_S)
    finally:
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(running, TIMEOUT_S)


async def transcribe(server: str, wav_path: str) -> dict:
    with wave.open(wav_path) as f:
        rate, pcm = f.getframerate(), f.readframes(f.getnframes())
    stt = NvidiaSTTService(server=server, use_ssl=False, sample_rate=rate)
    collector = Collector(TranscriptionFrame)
    task = PipelineWorker(Pipeline([stt, collector]), params=PipelineParams(audio_in_sample_rate=rate))
    step = rate * 2 * FRAME_MS // 1000

    async def feed() -> None:
        for offset in range(0, len(pcm), step):
            await task.queue_frame(InputAudioRawFrame(audio=pcm[offset : offset + step], sample_rate=rate,
                                                      num_channels=1))
            await asyncio.sleep(FRAME_MS / 1000)
        silence = bytes(step)
        while not collector.done.is_set():  # the end of the utterance is the server's VAD's to hear
            await task.queue_frame(InputAudioRawFrame(audio=silence, sample_rate=rate, num_channels=1))
            await asyncio.sleep(FRAME_MS / 1000)

    await run(task, collector, feed)
    frames = collector.frames
    return {"transcript": " ".join(f.text for f in frames if isinstance(f, TranscriptionFrame)),
            "interim_count": sum(isinstance(f, InterimTranscriptionFrame) for f in frames),
            "stt_errors": [f.error for f in frames if isinstance(f, ErrorFrame)]}


async def synthesize(server: str, voice: str, text: str, rate: int) -> dict:
    tts = NvidiaTTSService(server=server, use_ssl=False, sample_rate=rate,
                           settings=NvidiaTTSService.Settings(voice=voice))
    collector = Collector(TTSStoppedFrame)
    task = PipelineWorker(Pipeline([tts, collector]), params=PipelineParams(audio_out_sample_rate=rate))
    await run(task, collector, lambda: task.queue_frame(TTSSpeakFrame(text)))
    audio = [f for f in collector.frames if isinstance(f, TTSAudioRawFrame)]
    return {"tts_audio_bytes": sum(len(f.audio) for f in audio),
            "tts_sample_rate": sorted({f.sample_rate for f in audio}),
            "tts_frames": len(audio),
            "tts_errors": [f.error for f in collector.frames if isinstance(f, ErrorFrame)]}


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--asr", required=True, help="host:port of specvox's asr service")
    parser.add_argument("--tts", required=True, help="host:port of specvox's tts service")
    parser.add_argument("--wav", required=True, help="16-bit mono speech to transcribe")
    parser.add_argument("--voice", required=True, help="the voice to ask for (GetRivaSynthesisConfig lists it)")
    parser.add_argument("--text", default="The capital of France is Paris.")
    parser.add_argument("--rate", type=int, default=16_000, help="the TTS sample rate to ask for, in Hz")
    args = parser.parse_args(argv)
    result = await transcribe(args.asr, args.wav) | await synthesize(args.tts, args.voice, args.text, args.rate)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
