"""`specvox bench openai-http`: time to first byte of the OpenAI HTTP endpoints, beside the native calls they wrap.

Against one `specvox up`, one request at a time, alternating:

- chat: `POST /v1/chat/completions` with `stream: true` (greedy, `max_tokens` capped), from the request
  sent to the first chunk that carries text, and to `data: [DONE]`; beside it llm's native `Reply` on a
  session holding the same conversation, to its first step with text and its last;
- speech: `POST /v1/audio/speech` (`pcm`, two sentences), from the request sent to the first audio
  byte and to the last; beside it tts's native `Synthesize` at 24 kHz, to its first audio chunk and
  its last event.

The difference between a row and its native twin is what the HTTP surface costs (conversion, a
session written to Redis for a chat, SSE or chunked framing). Prints p50/p95 per row and writes JSON.
The client is aiohttp, not an SDK, so that nothing but the wire is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = ("What is the capital of France?", "Why is the sky blue?", "Tell me a fun fact about octopuses.",
           "How do I boil an egg?", "What should I read next?", "Name three colours.")
SPEECH = "Good morning, and welcome back. Here is the weather for today, and the news after it."
MAX_TOKENS = 48


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p95": None}
    return {"n": len(values), "p50": round(statistics.median(values), 1),
            "p95": round(float(np.percentile(values, 95, method="nearest")), 1)}


async def http_chat(http, base: str, model: str, prompt: str) -> tuple[float, float]:
    """(ms to the first chunk with text, ms to [DONE])."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0,
            "max_tokens": MAX_TOKENS}
    started, first = time.perf_counter(), None
    async with http.post(f"{base}/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    done = time.perf_counter()
    return _ms(started, first or done), _ms(started, done)


async def http_speech(http, base: str) -> tuple[float, float]:
    """(ms to the first audio byte, ms to the last)."""
    body = {"model": "tts-1", "voice": "alloy", "input": SPEECH, "response_format": "pcm"}
    started, first = time.perf_counter(), None
    async with http.post(f"{base}/audio/speech", json=body) as response:
        response.raise_for_status()
        async for piece in response.content.iter_any():
            if first is None and piece:
                first = time.perf_counter()
    done = time.perf_counter()
    return _ms(started, first or done), _ms(started, done)


async def native_reply(stub, redis, pb, prompt: str) -> tuple[float, float]:
    """llm's Reply as the gateway's own turns reach it: a session and a turn in Redis, then the stream."""
    started, first = time.perf_counter(), None
    session = await redis.sessions.create("")
    turn = await redis.turns.create(session)
    async for step in stub.Reply(pb.ReplyRequest(session_id=session, turn_id=turn, user_text=prompt,
                                                 max_new_tokens=MAX_TOKENS, defer_history=True)):
        if first is None and step.text_delta:
            first = time.perf_counter()
    done = time.perf_counter()
    return _ms(started, first or done), _ms(started, done)


async def native_speech(stub, pb) -> tuple[float, float]:
    started, first = time.perf_counter(), None
    async for event in stub.Synthesize(pb.SynthesizeRequest(text=SPEECH, sample_rate_hz=24_000)):
        if first is None and event.WhichOneof("event") == "audio":
            first = time.perf_counter()
    done = time.perf_counter()
    return _ms(started, first or done), _ms(started, done)


def _ms(started: float, at: float) -> float:
    return (at - started) * 1000


ROWS = (("chat: first chunk", "chat", 0), ("chat: [DONE]", "chat", 1),
        ("llm Reply (native): first text", "reply", 0), ("llm Reply (native): last step", "reply", 1),
        ("speech: first byte", "speech", 0), ("speech: last byte", "speech", 1),
        ("tts Synthesize (native): first audio", "synthesize", 0),
        ("tts Synthesize (native): last event", "synthesize", 1))


async def measure(stack, redis_url: str, requests: int) -> dict[str, list[tuple[float, float]]]:
    import aiohttp
    import grpc

    from services.protos import load
    from services.settings import Settings
    from services.store.context import open_redis

    llm_pb, llm_grpc = load("llm")
    tts_pb, tts_grpc = load("tts")
    base = f"http://{stack.http}/v1"
    timings: dict[str, list[tuple[float, float]]] = {"chat": [], "reply": [], "speech": [], "synthesize": []}
    redis = await open_redis(Settings(redis_url=redis_url))
    try:
        async with aiohttp.ClientSession() as http, grpc.aio.insecure_channel(stack.addresses["llm"]) as llm, \
                grpc.aio.insecure_channel(stack.addresses["tts"]) as tts:
            async with http.get(f"{base}/models") as response:
                model = (await response.json())["data"][0]["id"]
            llm_stub, tts_stub = llm_grpc.LlmStub(llm), tts_grpc.TtsStub(tts)
            calls = {"chat": lambda p: http_chat(http, base, model, p), "reply": lambda p: native_reply(
                llm_stub, redis, llm_pb, p), "speech": lambda p: http_speech(http, base),
                     "synthesize": lambda p: native_speech(tts_stub, tts_pb)}
            for call in calls.values():  # warm: first calls load kernels and caches
                await call(PROMPTS[0])
            for i in range(requests):
                order = list(calls) if i % 2 == 0 else list(reversed(calls))  # load falls on each alike
                for name in order:
                    # a question of its own each time: llm's prefix cache gives neither path the other's prompt
                    prompt = f"{PROMPTS[i % len(PROMPTS)]} (Question {i + 1} of the {name} run.)"
                    timings[name].append(await calls[name](prompt))
                print(f"  request {i + 1}/{requests}: " + ", ".join(
                    f"{n} {timings[n][-1][0]:.0f}/{timings[n][-1][1]:.0f} ms" for n in calls), flush=True)
    finally:
        await redis.close()
    return timings


def summarize(timings: dict[str, list[tuple[float, float]]], requests: int) -> dict:
    return {"requests": requests, "max_tokens": MAX_TOKENS, "speech_text": SPEECH,
            "rows": {label: percentiles([t[which] for t in timings[name]]) for label, name, which in ROWS}}


def print_table(results: dict) -> None:
    print(f"\n{'ms from the request sent':<40} {'n':>3} {'p50':>8} {'p95':>8}")
    for label, p in results["rows"].items():
        print(f"{label:<40} {p['n']:>3} {_shown(p['p50']):>8} {_shown(p['p95']):>8}")


def _shown(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


def run(settings, requests: int, json_path: str | None) -> int:
    from services.stack import running_stack
    from services.store.embedded import EmbeddedRedis

    valkey = EmbeddedRedis()
    with running_stack(Path(tempfile.mkdtemp(prefix="specvox-openai-http-")), host=settings.host,
                       redis=valkey) as stack:
        timings = asyncio.run(measure(stack, valkey.url, requests))
    results = summarize(timings, requests)
    print_table(results)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20, help="requests of each kind (after one to warm up)")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/openai_http.json",
                        help="write the figures here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.requests, args.json_path)
