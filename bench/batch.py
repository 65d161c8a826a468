"""`specvox bench batch`: aggregate tokens/s of N concurrent sessions, batched against one at a time.

N dialogue prompts of shared/data/prompts.json (N = 1, 2, 4, 8) are answered either by the
single-request Generator one after another, or together by the BatchedDecoder (one target
pass per step over every row). Throughput is all new tokens over the wall time of the
whole set; `identical` says whether every batched reply equals its one-at-a-time twin
(greedy, so it should, up to float rounding of a different batch shape).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipeline.llm.batch import BatchedDecoder
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import load_model
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat

SESSIONS = (1, 2, 4, 8)
# Plain decoding and the best model-free drafter of `bench spec`, the latter also with the
# verification pass capped at 16 positions (rows × (γ + 1), see pipeline/llm/batch.py).
VARIANTS = (("none", None), ("suffix", None), ("suffix", 16))


def run(settings, max_new_tokens: int, json_path: str | None, sessions: tuple[int, ...] = SESSIONS) -> int:
    loaded = load_model(settings.llm)
    generator = Generator.from_options(loaded, settings.llm)
    generator.warm_up()
    dialogue = load_prompts()["dialogue"]
    encoded = [tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, p))) for p in dialogue]
    rows = []
    alone: dict[tuple[str, int], tuple[float, list[list[int]]]] = {}
    for drafter, max_verify_tokens in VARIANTS:
        for n in sessions:
            requests = [GenerationRequest(encoded[i % len(encoded)], max_new_tokens, drafter) for i in range(n)]
            if (drafter, n) not in alone:  # the single path has no cap: measure it once
                alone[drafter, n] = _one_at_a_time(generator, requests)
            one_s, one_out = alone[drafter, n]
            batch_s, batch_out, widths = _batched(generator, requests, max_verify_tokens)
            tokens = sum(map(len, batch_out))
            row = {
                "drafter": drafter, "max_verify_tokens": max_verify_tokens, "sessions": n,
                "max_new_tokens": max_new_tokens,
                "dtype": settings.llm.dtype, "device": settings.llm.device,
                "one_at_a_time_tokens_per_s": round(sum(map(len, one_out)) / one_s, 2),
                "batched_tokens_per_s": round(tokens / batch_s, 2),
                "mean_rows_per_step": round(sum(widths) / len(widths), 2) if widths else 0.0,
                "identical": batch_out == one_out,
            }
            row["batched_speedup"] = round(row["batched_tokens_per_s"] / row["one_at_a_time_tokens_per_s"], 3)
            rows.append(row)
            print(f"  {drafter:<7} cap={max_verify_tokens} N={n}  "
                  f"one-at-a-time {row['one_at_a_time_tokens_per_s']:7.1f} tok/s  "
                  f"batched {row['batched_tokens_per_s']:7.1f} tok/s", flush=True)
    print_table(rows)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def _one_at_a_time(generator: Generator, requests: list[GenerationRequest]) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = [[t for step in generator.steps(r) for t in step.token_ids] for r in requests]
    return time.perf_counter() - started, outputs


def _batched(generator: Generator, requests: list[GenerationRequest], max_verify_tokens: int | None
             ) -> tuple[float, list[list[int]], list[int]]:
    decoder = BatchedDecoder(generator, max_batch_size=len(requests), max_verify_tokens=max_verify_tokens)
    started = time.perf_counter()
    index = {id(decoder.add(r)): i for i, r in enumerate(requests)}
    outputs: list[list[int]] = [[] for _ in requests]
    while decoder.rows:
        for row, step in decoder.step():
            outputs[index[id(row)]] += step.token_ids
    return time.perf_counter() - started, outputs, decoder.counters.widths


def print_table(rows: list[dict]) -> None:
    print(f"\n{'drafter':<8} {'cap':>4} {'N':>2} {'one-at-a-time tok/s':>20} {'batched tok/s':>14} {'speedup':>8} "
          f"{'rows/step':>10} {'identical':>10}")
    for r in rows:
        cap = "-" if r["max_verify_tokens"] is None else r["max_verify_tokens"]
        print(f"{r['drafter']:<8} {cap:>4} {r['sessions']:>2} {r['one_at_a_time_tokens_per_s']:>20.1f} "
              f"{r['batched_tokens_per_s']:>14.1f} {r['batched_speedup']:>7.2f}x {r['mean_rows_per_step']:>10.2f} "
              f"{str(r['identical']):>10}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--sessions", default="1,2,4,8", help="concurrent session counts to measure")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/batch.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.max_new_tokens, args.json_path, tuple(int(n) for n in args.sessions.split(",")))
