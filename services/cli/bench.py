"""`specvox bench NAME [its arguments]`: a benchmark of bench/, found by name and run with its own arguments.

The one way from services/ to bench/, and no import: the module is looked up by name here
(importlib), so bench/ imports services/ and never the other way round. Each benchmark module
has `add_arguments(parser)` and `run_from_args(settings, args) -> int`; `specvox bench NAME --help`
shows its arguments.
"""

from __future__ import annotations

import argparse
import importlib

from services.cli.command import Command

BENCHMARKS = {  # the name on the command line -> the module under bench/
    "turn": "turn", "asr": "asr", "spec": "spec", "spec-plots": "spec_plots", "step": "step_split", "tts": "tts",
    "batch": "batch", "e2e": "e2e", "end-of-turn": "end_of_turn", "fuzz": "fuzz", "soak": "soak",
    "faults": "faults", "lossless": "lossless", "tts-allocator": "tts_allocator", "captions": "captions",
    "file-captions": "file_captions", "asr-finals": "asr_finals", "openai-http": "openai_http",
    "page": "page", "surfaces": "surfaces",
}


def bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=BENCHMARKS, help="the benchmark")
    parser.add_argument("arguments", nargs=argparse.REMAINDER,
                        help="the benchmark's own (specvox bench NAME --help)")


def run_bench(settings, args: argparse.Namespace) -> int:
    module = importlib.import_module(f"bench.{BENCHMARKS[args.what]}")
    parser = argparse.ArgumentParser(prog=f"specvox bench {args.what}",
                                     description=(module.__doc__ or "").strip().split("\n")[0])
    module.add_arguments(parser)
    return module.run_from_args(settings, parser.parse_args(args.arguments))


COMMANDS = (Command("bench", "benchmarks that print a table and write JSON", bench_arguments, run_bench),)
