"""The command line's table: every subcommand parses its own arguments, and `specvox bench NAME`
hands the rest to the benchmark's own parser."""

from __future__ import annotations

import argparse
import importlib

import pytest

from services.cli import COMMANDS, parser
from services.cli.bench import BENCHMARKS


def test_each_subcommand_is_in_the_table_once():
    names = [c.name for c in COMMANDS]
    assert sorted(names) == sorted({"up", "serve", "client", "say", "demo", "captions", "keys", "health", "generate",
                                    "train-draft", "bench"})


@pytest.mark.parametrize(("argv", "expected"), [
    (["up", "--services", "llm,tts", "--workers", "llm=2"], {"services": ("llm", "tts"), "workers": {"llm": 2}}),
    (["serve", "tts"], {"service": "tts"}),
    (["client", "--wav", "q.wav", "--no-realtime"], {"wav": "q.wav", "no_realtime": True, "out": "out/client"}),
    (["say", "hello", "--out", "a.wav"], {"text": "hello", "sample_rate": 16_000, "pad_s": 0.5}),
    (["demo"], {"wav": None, "out": "out/demo"}),
    (["captions", "talk.mp4", "--out", "talk.srt"], {"input": "talk.mp4", "out": "talk.srt", "format": None,
                                                      "max_duration_s": 3 * 3600, "cleaner": "llm", "quiet": False}),
    (["client", "--file", "talk.mp4", "--caption", "--no-realtime"], {"wav": "talk.mp4", "caption": True,
                                                                        "no_realtime": True}),
    (["keys", "revoke", "acme"], {"action": "revoke", "name": "acme"}),
    (["health", "gateway"], {"address": "gateway"}),
    (["generate", "--prompt", "hi", "--weights", "dense"], {"prompt": "hi", "weights": "dense", "max_new_tokens": 128}),
    (["train-draft", "--kind", "medusa", "--evaluate", "4"], {"kind": "medusa", "evaluate": 4, "epochs": 3}),
    (["bench", "e2e", "--sessions", "1", "--turns", "2"],
     {"what": "e2e", "arguments": ["--sessions", "1", "--turns", "2"]}),
])
def test_each_subcommand_parses_its_own_arguments(argv, expected):
    args = parser()[0].parse_args(argv)
    assert {key: getattr(args, key) for key in expected} == expected


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_takes_its_own_arguments(name):
    module = importlib.import_module(f"bench.{BENCHMARKS[name]}")
    bench_parser = argparse.ArgumentParser(prog=f"specvox bench {name}")
    module.add_arguments(bench_parser)
    assert callable(module.run_from_args)
    options = {option for action in bench_parser._actions for option in action.option_strings}
    assert name == "spec-plots" or "--json" in options
    with pytest.raises(SystemExit):
        bench_parser.parse_args(["--no-such-option"])


@pytest.mark.parametrize(("argv", "expected"), [
    (["captions", "a.wav"], "vtt"), (["captions", "a.wav", "--out", "a.srt"], "srt"),
    (["captions", "a.wav", "--out", "a.JSON"], "json"), (["captions", "a.wav", "--out", "a.txt"], "vtt"),
    (["captions", "a.wav", "--out", "a.srt", "--format", "vtt"], "vtt"),
])
def test_the_caption_format_comes_from_format_then_the_out_extension(argv, expected):
    from services.cli.captions import output_format

    assert output_format(parser()[0].parse_args(argv)) == expected
