"""`specvox bench tts`: how soon the tts stage speaks a reply that is still being written, and how fast it synthesizes.

The tts service runs in this process on loopback gRPC with an embedded Valkey, with the
configured backend (`--backend` overrides it; run from the Coqui environment to measure
Coqui). Each reply is written to its turn's Redis stream one word at a time, a word every
`--token-ms` (an LLM's pace), while `SpeakTurn` tails it. Per reply:

- `first_token_to_audio_ms`: first token written → first audio chunk received;
- `phrase_to_audio_ms`: the token that completes the first phrase written → first audio chunk
  received (the goal with Piper: ≤150 ms);
- `first_phrase_audio_s`: how long the first phrase sounds;
- `rtf`: synthesis time / audio duration over the whole reply, phrase by phrase, in this
  process without the transport (the goal with Piper: ≤0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import statistics
import time
from pathlib import Path

import grpc

from pipeline.tts.phrases import PhraseCutter
from pipeline.tts.speaker import ReplySpeaker
from pipeline.tts.synthesizers import load_synthesizer

REPLIES = [
    "Sure, I can help with that. Paris is the capital of France, and it sits on the river Seine.",
    "Honestly, it depends on the weather. If it rains tomorrow, we could visit the museum instead.",
    "Bees make honey from nectar. They carry it back to the hive, where it slowly thickens into honey.",
    "Good question! Cats purr when they are content, but sometimes also when they are stressed or hurt.",
    "That will cost about $1,200 in total, which is 15% more than last year. Shall I book it?",
    "Well, the meeting moved to Thursday at 3:30 pm. I will send everyone a reminder on the 21st.",
]


def run(settings, backend: str, token_ms: float, threads: int, json_path: str | None) -> int:
    tts_options = dataclasses.replace(settings.tts, backend=backend or settings.tts.backend,
                                      threads=threads if threads else settings.tts.threads)
    synthesizer = load_synthesizer(tts_options)
    synthesizer.warm_up()
    load_before, phrases = os.getloadavg()[0], settings.phrases
    rows = asyncio.run(_latencies(settings, synthesizer, token_ms))
    for row in rows:
        row |= _rtf(settings, synthesizer, row.pop("text"))
        row |= {"backend": synthesizer.name, "token_ms": token_ms, "threads": tts_options.threads,
                "first_phrase_chars": [phrases.first_phrase_min_chars, phrases.first_phrase_max_chars],
                "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}  # before, after
    print_table(rows)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


async def _latencies(settings, synthesizer, token_ms: float) -> list[dict]:
    from services.channels import message_size_options
    from services.protos import load
    from services.stages.tts import TtsServicer
    from services.store.context import open_redis
    from services.store.embedded import EmbeddedRedis

    pb, pb_grpc = load("tts")
    with EmbeddedRedis() as valkey:
        settings = settings.model_copy(update={"redis_url": valkey.url})
        redis = await open_redis(settings)
        server = grpc.aio.server(options=message_size_options(settings.max_message_bytes))
        pb_grpc.add_TtsServicer_to_server(TtsServicer(settings, synthesizer, redis), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.TtsStub(channel)
                return [await _speak_reply(stub, pb, redis, settings, text, token_ms) for text in REPLIES]
        finally:
            await server.stop(grace=1)
            await redis.close()


async def _speak_reply(stub, pb, redis, settings, text: str, token_ms: float) -> dict:
    from services.store.client import now_ms
    from services.store.turn_log import TokenEntry, TokenStreamWriter

    tokens = re.findall(r"\S+\s*", text)
    completes = _first_phrase_token(tokens, settings)
    session_id = await redis.sessions.create("")
    turn_id = await redis.turns.create(session_id)
    writer = TokenStreamWriter(redis.client, turn_id)
    written: dict[int, float] = {}

    async def write() -> None:
        for seq, token in enumerate(tokens):
            written[seq] = time.perf_counter()
            await writer.append(TokenEntry(seq, (seq,), token, 1, now_ms()))
            await asyncio.sleep(token_ms / 1000)
        await writer.append(TokenEntry(len(tokens), (), "", 0, now_ms(), end=True, finish_reason="eos"))

    first_audio, first_phrase_s = 0.0, 0.0
    call = stub.SpeakTurn(pb.SpeakTurnRequest(session_id=session_id, turn_id=turn_id))
    task = asyncio.create_task(write())
    async for event in call:
        kind = event.WhichOneof("event")
        if kind == "audio" and not first_audio:
            first_audio = time.perf_counter()
        elif kind == "cue" and not first_phrase_s:
            first_phrase_s = event.cue.end_s - event.cue.start_s
    await task
    return {
        "text": text,
        "reply": text[:40],
        "first_token_to_audio_ms": round((first_audio - written[0]) * 1000, 1),
        "phrase_to_audio_ms": round((first_audio - written[completes]) * 1000, 1),
        "first_phrase_audio_s": round(first_phrase_s, 2),
    }


def _first_phrase_token(tokens: list[str], settings) -> int:
    """The index of the token after which the cutter has its first phrase."""
    cutter = PhraseCutter(settings.phrases)
    for i, token in enumerate(tokens):
        if cutter.feed(token):
            return i
    return len(tokens) - 1


def _rtf(settings, synthesizer, text: str) -> dict:
    speaker = ReplySpeaker(synthesizer)
    cutter = PhraseCutter(settings.phrases)
    started = time.perf_counter()
    for phrase in cutter.feed(text) + cutter.flush():
        for _ in speaker.speak(phrase):
            pass
    synth_s = time.perf_counter() - started
    return {"audio_s": round(speaker.end_s, 2), "rtf": round(synth_s / speaker.end_s, 3)}


def print_table(rows: list[dict]) -> None:
    cols = ["first_token_to_audio_ms", "phrase_to_audio_ms", "first_phrase_audio_s", "audio_s", "rtf"]
    print(f"\nbackend {rows[0]['backend']}, a word every {rows[0]['token_ms']:.0f} ms, "
          f"{rows[0]['threads']} thread(s), load average {rows[0]['load_average_1min']} (before, after)")
    print(f"{'reply':<42} " + " ".join(f"{c:>24}" for c in cols))
    for row in rows:
        print(f"{row['reply']:<42} " + " ".join(f"{row[c]:>24}" for c in cols))
    for name, fn in (("median", statistics.median), ("max", max)):
        print(f"{name:<42} " + " ".join(f"{fn([r[c] for r in rows]):>24.3g}" for c in cols))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="", help="piper or coqui (default: tts.backend)")
    parser.add_argument("--token-ms", type=float, default=40.0, help="a word of the reply every this many ms")
    parser.add_argument("--threads", type=int, default=0, help="model threads (default: tts.threads)")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/tts.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.backend, args.token_ms, args.threads, args.json_path)
