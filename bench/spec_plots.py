"""`specvox bench spec-plots`: speedup against draft length, acceptance by draft position (PNG).

For each fixed draft length γ (adaptation off) the chosen drafter decodes the prompt set;
speedup is against plain decoding (γ = 0) in the same process. Acceptance by position
aggregates, over the whole set, how often the i-th drafted token was accepted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import load_model
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat

GAMMAS = (1, 2, 3, 4, 6, 8)


def run(settings, drafter: str, limit: int, max_new_tokens: int, out_dir: str) -> int:
    prompts = load_prompts()
    loaded = load_model(settings.llm)
    generator = Generator(loaded, early_exit_layers=settings.llm.early_exit_layers,
                          static_cache=settings.llm.static_cache)
    results = {}
    for workload in ("dialogue", "caption"):
        encoded = [tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, p)))
                   for p in prompts[workload][:limit]]
        plain = _throughput(generator, encoded, "none", 0, max_new_tokens)[0]
        rows = []
        for gamma in GAMMAS:
            tok_s, drafted, accepted = _throughput(generator, encoded, drafter, gamma, max_new_tokens)
            by_position = [a / d if d else None for a, d in zip(accepted, drafted, strict=True)]
            rows.append({"gamma": gamma, "speedup": tok_s / plain, "acceptance_by_position": by_position})
            print(f"  {workload:<9} γ={gamma}  {tok_s / plain:.2f}×", flush=True)
        results[workload] = rows
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, drafter, out)
    print(f"wrote {out}/spec_speedup_vs_gamma.png, {out}/spec_acceptance_by_position.png, {out}/spec_sweep.json")
    return 0


def _throughput(generator: Generator, prompts, drafter: str, gamma: int, max_new: int):
    tokens, seconds = 0, 0.0
    drafted: list[int] = []
    accepted: list[int] = []
    for prompt in prompts:
        request = GenerationRequest(prompt, max_new, drafter, max_draft_tokens=gamma, adaptive_draft=False)
        started = time.perf_counter()
        tokens += sum(step.accepted for step in generator.steps(request))
        seconds += time.perf_counter() - started
        stats = generator.last_stats
        drafted = _add(drafted, stats.drafted_at)
        accepted = _add(accepted, stats.accepted_at)
    return tokens / seconds, drafted, accepted


def _add(total: list[int], more: list[int]) -> list[int]:
    width = max(len(total), len(more))
    return [(total[i] if i < len(total) else 0) + (more[i] if i < len(more) else 0) for i in range(width)]


def _plot(results: dict, drafter: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for workload, rows in results.items():
        ax.plot([r["gamma"] for r in rows], [r["speedup"] for r in rows], marker="o", label=workload)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="draft length γ (fixed)", ylabel="speedup vs plain decoding", title=f"{drafter} drafter")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "spec_speedup_vs_gamma.png", dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for workload, rows in results.items():
        widest = rows[-1]["acceptance_by_position"]
        ax.plot(range(1, len(widest) + 1), widest, marker="o", label=f"{workload}, γ={rows[-1]['gamma']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title=f"{drafter} drafter")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "spec_acceptance_by_position.png", dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", default="suffix", help="the drafter swept over draft lengths")
    parser.add_argument("--limit", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--out", default="docs/benchmarks/results", help="folder for the PNGs and JSON")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.drafter, args.limit, args.max_new_tokens, args.out)
