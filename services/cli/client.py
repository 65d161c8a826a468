"""`specvox client` (a WAV streamed to the gateway, the reply saved; with --caption, a media file's captions
made through the gateway) and `specvox say` (text spoken into a WAV by the configured voice: a question to
ask the stack)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from services.cli.command import Command


def client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wav", "--file", dest="wav", required=True,
                        help="16-bit PCM WAV, mono or stereo, 8-48 kHz; with --caption, any file `specvox captions` "
                             "takes (WAV, FLAC, MP3, MP4, MKV, WebM)")
    parser.add_argument("--address", default="", help="gateway host:port (default: from settings)")
    parser.add_argument("--out", default="out/client", help="folder for reply.wav, captions.vtt, report.json "
                                                            "(--caption: captions.vtt, captions.srt, captions.json)")
    parser.add_argument("--no-realtime", action="store_true",
                        help="send the audio as fast as possible (--caption: as fast as the gateway takes it)")
    parser.add_argument("--caption", action="store_true",
                        help="caption mode: no replies; every utterance of the file comes back as a timed caption")


def run_client(settings, args: argparse.Namespace) -> int:
    from services.client import ClientOptions, converse, write_outputs

    options = ClientOptions(realtime=not args.no_realtime, max_message_bytes=settings.max_message_bytes,
                            api_key=settings.auth.api_key, tls=settings.tls)
    if args.caption:
        return run_caption_client(settings, args, options)
    turns = asyncio.run(converse(args.address or settings.address("gateway"), args.wav, options))
    print_summary(write_outputs(turns, args.out), Path(args.out))
    return 0


def print_summary(report: dict, out: Path) -> None:
    print()
    print(f"you said        {report['transcript']}")
    print(f"avatar said     {report['reply_text']}")
    print(f"voice to voice  {report['voice_to_voice_ms']} ms  (end of your speech → first reply audio; "
          f"budget {report['budget_ms']} ms)")
    print(f"reply audio     {report['reply_audio_s']} s")
    print("stage timings, ms after the end of your speech:")
    print(f"  {'stage':<8} {'first in':>9} {'first out':>10} {'last out':>9}")
    for stage, times in report["stages"].items():
        rel = times["ms_after_speech_end"]
        print(f"  {stage:<8} {rel['first_in']:>9} {rel['first_out']:>10} {rel['last_out']:>9}")
    print(f"wrote {out}/reply.wav, {out}/captions.vtt, {out}/report.json")


def run_caption_client(settings, args: argparse.Namespace, options) -> int:
    """The file through the gateway in caption mode; exit 2 for a file that cannot be captioned (as
    `specvox captions`)."""
    import sys

    from pipeline.media import MediaError
    from services.client import caption_file

    try:
        result = asyncio.run(caption_file(args.address or settings.address("gateway"), args.wav, options))
    except MediaError as e:
        print(f"specvox client: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, document in result.documents().items():
        (out / name).write_text(document)
    speed = result.audio_s / result.total_s if result.total_s else 0.0
    print(f"captioned {result.audio_s:.1f} s of audio through the gateway in {result.total_s:.1f} s "
          f"({speed:.1f}x real time; the audio was sent in {result.sent_s:.1f} s, the first caption came after "
          f"{result.first_caption_s:.1f} s): {len(result.captions)} captions, "
          f"{len(result.failed)} utterances without one")
    for failure in result.failed:
        print(f"  no caption ({failure['finish_reason']}): {failure['transcript']!r}")
    print(f"wrote {out}/captions.vtt, {out}/captions.srt, {out}/captions.json")
    return 0 if not result.failed else 1


def say_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sample-rate", type=int, default=16_000)
    parser.add_argument("--pad-s", type=float, default=0.5, help="silence before and after the speech")


def run_say(settings, args: argparse.Namespace) -> int:
    return say_to_file(settings, args.text, args.out, args.sample_rate, args.pad_s)


def say_to_file(settings, text: str, out: str, sample_rate_hz: int, pad_s: float) -> int:
    import numpy as np

    from pipeline.audio import float_to_pcm16, wav_bytes
    from pipeline.tts.speech_text import speech_text
    from pipeline.tts.synthesizers import load_synthesizer

    audio = load_synthesizer(settings.tts).synthesize(speech_text(text).spoken, sample_rate_hz)  # as tts says it
    pad = np.zeros(int(pad_s * sample_rate_hz), np.float32)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "wb") as f:
        f.write(wav_bytes(float_to_pcm16(np.concatenate([pad, audio, pad])), sample_rate_hz))
    print(f"wrote {out} ({audio.size / sample_rate_hz:.2f} s of speech)")
    return 0


COMMANDS = (
    Command("client", "stream a WAV to the gateway and save the reply", client_arguments, run_client,
            log_level="WARNING"),
    Command("say", "synthesize text with the configured voice into a WAV file", say_arguments, run_say),
)
