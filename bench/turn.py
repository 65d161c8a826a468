"""`specvox bench turn`: voice-to-voice latency of whole spoken turns through `specvox up`.

Each question of the dialogue prompt set is spoken by the bundled voice and streamed in
real time to a fresh session; the table gives, per turn, the end of speech → first
reply audio time and when each stage first emitted, relative to the end of speech.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from pipeline.llm.prompt_sets import load_prompts
from services.cli.client import say_to_file
from services.client import ClientOptions, converse
from services.stack import running_stack


def questions(limit: int) -> list[str]:
    return load_prompts()["dialogue"][:limit]


def run(settings, turns: int, json_path: str | None) -> int:
    work = Path(tempfile.mkdtemp(prefix="specvox-bench-"))
    wavs = []
    for i, text in enumerate(questions(turns)):
        wavs.append((text, str(work / f"q{i}.wav")))
        say_to_file(settings, text, wavs[-1][1], sample_rate_hz=16_000, pad_s=0.5)
    rows, restarted = [], 0
    with running_stack(work, host=settings.host) as stack:
        for text, wav in wavs:
            results = asyncio.run(converse(stack.addresses["gateway"], wav,
                                           ClientOptions(api_key=settings.auth.api_key, tls=settings.tls)))
            reports = [r.report for r in results if r.report]
            # A turn the final contradicted, or one cancelled because the user spoke on before
            # hearing it (its words begin the next turn), answered nothing: the turn after it did.
            answered = [r for r in reports if r["preemption"] != "dropped" and r["finish_reason"] != "cancelled"]
            restarted += sum(r["finish_reason"] == "cancelled" and r["preemption"] != "dropped" for r in reports)
            rows += [_row(text, r) for r in answered]
            print(f"  {len(rows)}/{len(wavs)} turns", flush=True)
    print_table(rows)
    print(f"turns restarted because the user spoke on before hearing the reply: {restarted}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def _row(question: str, report: dict) -> dict:
    rel = {stage: t["ms_after_speech_end"] for stage, t in report["stages"].items()}
    return {
        "question": question,
        "transcript": report["transcript"],
        "voice_to_voice_ms": report["voice_to_voice_ms"],
        "asr_final_ms": rel["asr"]["last_out"],
        "llm_first_token_ms": rel["llm"]["first_out"],
        "tts_first_audio_ms": rel["tts"]["first_out"],
        "reply_audio_s": report["reply_audio_s"],
        "finish_reason": report["finish_reason"],
        "preemption": report["preemption"],
    }


def print_table(rows: list[dict]) -> None:
    cols = ["voice_to_voice_ms", "asr_final_ms", "llm_first_token_ms", "tts_first_audio_ms", "reply_audio_s"]
    print(f"\n{'question':<48} " + " ".join(f"{c:>19}" for c in cols))
    for row in rows:
        print(f"{row['question'][:47]:<48} " + " ".join(f"{row[c]:>19}" for c in cols))
    for name, fn in (("p50", statistics.median), ("p95", lambda v: np.percentile(v, 95, method="nearest"))):
        print(f"{name:<48} " + " ".join(f"{fn([r[c] for r in rows]):>19.0f}" for c in cols))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=8, help="spoken turns (the first questions of the dialogue set)")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/turn.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.turns, args.json_path)
