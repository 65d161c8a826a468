"""`specvox demo`: one spoken turn through `specvox up` and the reference client.

Makes a spoken question with the bundled voice unless given a WAV, starts the whole stack as a
user would (services/stack.py), streams the question in real time, prints what happened and
writes reply.wav, captions.vtt and report.json.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from services.cli.client import print_summary, say_to_file
from services.cli.command import Command
from services.stack import running_stack

DEFAULT_QUESTION = "Can you recommend a good book for a long train ride?"


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wav", help="your own question (default: one made with the bundled voice)")
    parser.add_argument("--out", default="out/demo")


def run_demo(settings, args: argparse.Namespace) -> int:
    from services.client import ClientOptions, converse, write_outputs

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wav = args.wav
    if not wav:
        wav = str(out / "question.wav")
        say_to_file(settings, DEFAULT_QUESTION, wav, sample_rate_hz=16_000, pad_s=0.5)
    with running_stack(out, host=settings.host) as stack:
        print(f"streaming {wav} to the gateway in real time …", flush=True)
        options = ClientOptions(max_message_bytes=settings.max_message_bytes, api_key=settings.auth.api_key,
                                tls=settings.tls)
        turns = asyncio.run(converse(stack.addresses["gateway"], wav, options))
        report = write_outputs(turns, str(out))
    print_summary(report, out)
    return 0


COMMANDS = (Command("demo", "one spoken turn through `specvox up` and the client", demo_arguments, run_demo),)
