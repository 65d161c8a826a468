"""LiveKit Agents' `openai.realtime.RealtimeModel(base_url=...)` against specvox's Realtime API.

Run in the clients' environment (`make clients`, requirements/clients.txt). tests/e2e/test_realtime.py
runs it as a subprocess:

    python livekit_realtime.py ws://HOST:PORT/v1/realtime VOICE question.pcm

LiveKit's `AgentSession` needs a LiveKit server and a room to carry the user's audio (a WebRTC
media server), which an offline test machine does not have; the model's `RealtimeSession` is the
part that speaks the Realtime API, and it runs on its own: this script pushes the question (24 kHz
mono 16-bit PCM) into it as `rtc.AudioFrame`s at real-time pace, then silence, as a room's track
would, and reads what LiveKit makes of the server's events: the user's transcript, the generation
with its audio and text streams. Then it adds a typed user message to the chat context
(`update_chat_ctx`) and calls `generate_reply()`, whose future resolves only when the server's
`response.created` carries LiveKit's own `client_event_id` in its metadata. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from livekit import rtc
from livekit.agents import llm
from livekit.plugins import openai

RATE = 24_000
FRAME_MS = 40


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("voice")
    parser.add_argument("question")
    parser.add_argument("--api-key", default="sk-specvox")
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args()
    speech = open(args.question, "rb").read()
    base_url = args.url.replace("ws://", "http://").replace("wss://", "https://").removesuffix("/realtime")

    model = openai.realtime.RealtimeModel(base_url=base_url, api_key=args.api_key, voice=args.voice)
    session = model.session()
    result: dict = {"errors": [], "generations": 0, "audio_s": 0.0, "text": [], "user": "", "events": []}
    replies_done = asyncio.Event()
    consumers: list[asyncio.Task] = []

    session.on("openai_server_event_received", lambda event: result["events"].append(event["type"]))
    session.on("error", lambda error: result["errors"].append(str(getattr(error, "error", error))))
    session.on("input_audio_transcription_completed",
               lambda event: result.__setitem__("user", event.transcript) if event.is_final else None)

    async def consume(generation: llm.GenerationCreatedEvent) -> None:
        async for message in generation.message_stream:
            async def audio(stream) -> None:
                async for frame in stream:
                    result["audio_s"] += frame.samples_per_channel / frame.sample_rate

            async def text(stream) -> None:
                async for piece in stream:
                    result["text"].append(str(piece))

            await asyncio.gather(audio(message.audio_stream), text(message.text_stream))
        result["generations"] += 1
        replies_done.set()

    session.on("generation_created", lambda generation: consumers.append(asyncio.create_task(consume(generation))))

    step = RATE * 2 * FRAME_MS // 1000
    start, sent = time.monotonic(), 0

    async def microphone(pcm: bytes) -> None:
        nonlocal sent
        while True:
            piece, pcm = pcm[:step], pcm[step:]
            session.push_audio(rtc.AudioFrame(piece.ljust(step, b"\0"), RATE, 1, step // 2))
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * FRAME_MS / 1000 - time.monotonic()))

    mic = asyncio.create_task(microphone(speech))
    try:
        await asyncio.wait_for(replies_done.wait(), args.timeout)  # the spoken question's answer
        chat = session.chat_ctx.copy()
        chat.add_message(role="user", content="Thank you. Say goodbye.")
        await asyncio.wait_for(session.update_chat_ctx(chat), args.timeout)
        replies_done.clear()
        generation = await asyncio.wait_for(session.generate_reply(), args.timeout)
        result["reply_metadata_ok"] = generation.user_initiated  # response.created carried its client_event_id
        await asyncio.wait_for(replies_done.wait(), args.timeout)  # the generation_created handler reads it
    except (TimeoutError, llm.RealtimeError) as e:
        result["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        mic.cancel()
        for task in consumers:
            task.cancel()
        await session.aclose()
        await model.aclose()
    result["text"] = "".join(result["text"])
    result["events"] = sorted(set(result["events"]))
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
