"""`specvox bench step`: where a decoding step's time goes, path by path, in one process.

A one-token step and a verification pass (`VERIFY_TOKENS`: the last token and its drafts)
of the lean pass, on a dialogue prompt's cache, for three paths over the same weights
(`llm.weights`, int4-exact where it applies):

- `torch-ops+DynamicCache`: the pass through torch's operations into transformers'
  `DynamicCache`, as before the preallocated cache and the C++ step (the baseline);
- `torch-ops+KVCache`: the same operations into the preallocated `KVCache`;
- `fused+KVCache`: the decoder layers in one C++ call (`LeanStep`, int4-exact only).

Each pass is timed alone (median of `REPS`, every path in turn per repetition, so load
drifts alike), then split under torch's profiler: matrix products, attention, cache update,
norms/rotary/elementwise (torch's other operations), and Python/dispatch (the pass's time in
no operation). The C++ step reports its own parts. The profiler adds its cost to the
Python/dispatch part, so the split's total exceeds the untimed median; read the split as
shares. Then plain decoding through the engine (`Generator`, drafter `none`), whose time
outside the target pass is the step's sampling and host work. Speed is printed and written
as JSON, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.exact_codes import kernel_threads
from pipeline.llm.lean_llama import LeanLlama
from pipeline.llm.model import LoadedModel, load_model, rollback
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat

PARTS = ("products", "attention", "cache", "elementwise", "python")
PART_NAMES = {"products": "matrix products", "attention": "attention", "cache": "cache update",
              "elementwise": "norms/rotary/elementwise", "python": "Python/dispatch"}
KERNEL_PARTS = ("products", "attention", "cache", "elementwise")  # the C++ step's timings, in its order


@dataclasses.dataclass
class StepPath:
    name: str
    lean: LeanLlama
    dynamic: bool  # fill a transformers DynamicCache instead of a KVCache


REPS = 20  # timed passes of each path and length
VERIFY_TOKENS = 9  # a verification pass: the last token and 8 drafted ones (llm.max_draft_tokens' default)


def run(settings: Any, max_new_tokens: int, json_path: str | None, reps: int = REPS,
        verify_tokens: int = VERIFY_TOKENS) -> int:
    loaded = load_model(settings.llm)
    lean = loaded.lean
    if lean is None:
        print("bench step: the target has no lean pass (llm.lean_forward=false or not a Llama model)")
        return 2
    unfused = lean.unfused()
    paths = [StepPath("torch-ops+DynamicCache", unfused, True), StepPath("torch-ops+KVCache", unfused, False)]
    if lean.step is not None:
        paths.append(StepPath("fused+KVCache", lean, False))
    prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, load_prompts()["dialogue"][0]))
    print(f"torch threads {torch.get_num_threads()}, kernel threads {kernel_threads()}, weights {loaded.weights}, "
          f"{settings.llm.dtype} on "
          f"{settings.llm.device}, context {len(prompt)} tokens", flush=True)
    rows = []
    for tokens in (1, verify_tokens):
        rows += _split_pass(paths, loaded, prompt, tokens, reps)
    engine = [_engine_row(dataclasses.replace(loaded, lean=path.lean), path.name, prompt, max_new_tokens)
              for path in paths if not path.dynamic]
    print_tables(rows, engine)
    if json_path:
        Path(json_path).write_text(json.dumps({"passes": rows, "engine": engine}, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def _new_cache(path: StepPath, loaded: LoadedModel) -> Any:
    if not path.dynamic:
        return None
    from transformers import DynamicCache

    return DynamicCache(config=loaded.model.config)


def _split_pass(paths: list[StepPath], loaded: LoadedModel, prompt: list[int], tokens: int, reps: int) -> list[dict]:
    """One row per path: the pass over `tokens` tokens on the prompt's cache, timed, then split."""
    device = loaded.device
    ids = torch.tensor([prompt[-tokens:]], device=device)
    caches = []
    for path in paths:
        cache = path.lean(input_ids=torch.tensor([prompt[:-tokens]], device=device), cache=_new_cache(path, loaded),
                          logits_to_keep=1).cache
        caches.append(cache)
    held = len(prompt) - tokens

    def one(i: int) -> None:
        paths[i].lean(input_ids=ids, cache=caches[i], logits_to_keep=tokens)
        rollback(caches[i], held)

    for _ in range(3):  # warm-up
        for i in range(len(paths)):
            one(i)
    times: list[list[float]] = [[] for _ in paths]
    for _ in range(reps):
        for i in range(len(paths)):
            started = time.perf_counter()
            one(i)
            times[i].append(time.perf_counter() - started)
    rows = []
    for i, path in enumerate(paths):
        split, ops = _profiled_split(path, caches[i], lambda i=i: one(i), reps)
        rows.append({"pass_tokens": tokens, "path": path.name, "median_ms": round(1e3 * statistics.median(times[i]), 3),
                     "torch_ops_per_pass": ops, **{f"{part}_ms": round(1e3 * split[part], 3) for part in PARTS},
                     "context_tokens": held, "torch_threads": torch.get_num_threads(),
                     "kernel_threads": kernel_threads()})
    return rows


class _Ranged:
    """Calls `inner` inside a profiler range named `name` (the products, the cache's update)."""

    def __init__(self, inner: Callable[..., Any], name: str) -> None:
        self.inner, self.name = inner, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(self.name):
            return self.inner(*args, **kwargs)


def _profiled_split(path: StepPath, cache: Any, one: Callable[[], None], reps: int) -> tuple[dict[str, float], int]:
    """Seconds per pass by part, and torch operations per pass, from `reps` profiled passes."""
    lean, linear = path.lean, path.lean.linear
    lean.linear = _Ranged(linear, "products")  # type: ignore[assignment]
    cache.update = _Ranged(cache.update, "cache")
    timings = torch.zeros(len(KERNEL_PARTS), dtype=torch.float64)
    lean.timings = timings
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(reps):
                with torch.profiler.record_function("pass"):
                    one()
    finally:
        lean.linear, lean.timings = linear, None
        del cache.update
    split = dict.fromkeys(PARTS, 0.0)
    passes = [e for e in profile.events() if e.name == "pass"]
    total = sum(e.cpu_time_total for e in passes) * 1e-6
    inside = 0.0
    ops = 0
    for event in profile.events():
        if event.cpu_parent is None or event.cpu_parent.name != "pass":
            continue
        seconds = event.cpu_time_total * 1e-6
        inside += seconds
        if event.name in ("products", "cache"):
            split[event.name] += seconds
        elif "scaled_dot_product_attention" in event.name:
            split["attention"] += seconds
        else:
            split["elementwise"] += seconds
        ops += event.name.startswith("aten::") or event.name == "products"
    kernel = timings.tolist()
    for part, seconds in zip(KERNEL_PARTS, kernel, strict=True):
        split[part] += seconds
    split["python"] = max(0.0, total - inside - sum(kernel))
    return {part: seconds / reps for part, seconds in split.items()}, round(ops / reps)


def _engine_row(loaded: LoadedModel, name: str, prompt: list[int], max_new_tokens: int) -> dict:
    """Plain decoding through the engine: tok/s, and per step the target pass and the rest."""
    generator = Generator(loaded)
    generator.warm_up()
    request = GenerationRequest(tuple(prompt), max_new_tokens, "none")
    started = time.perf_counter()
    tokens = sum(len(step.token_ids) for step in generator.steps(request))
    wall = time.perf_counter() - started
    stats = generator.last_stats
    decode = wall - stats.prefill_s
    return {"path": name, "new_tokens": tokens, "steps": stats.steps,
            "decode_tokens_per_s": round(stats.new_tokens / decode, 2) if decode else None,
            "target_ms_per_step": round(1e3 * stats.target_s / stats.steps, 3),
            "host_ms_per_step": round(1e3 * (decode - stats.target_s) / stats.steps, 3),
            "prefill_ms": round(1e3 * stats.prefill_s, 1), "torch_threads": torch.get_num_threads(),
            "kernel_threads": kernel_threads()}


def print_tables(rows: list[dict], engine: list[dict]) -> None:
    print(f"\n{'tokens':>6} {'path':<24} {'median ms':>10} {'ops':>6} "
          + " ".join(f"{PART_NAMES[p]:>{max(9, len(PART_NAMES[p]))}}" for p in PARTS))
    for r in rows:
        print(f"{r['pass_tokens']:>6} {r['path']:<24} {r['median_ms']:>10.2f} {r['torch_ops_per_pass']:>6} "
              + " ".join(f"{r[p + '_ms']:>{max(9, len(PART_NAMES[p]))}.2f}" for p in PARTS))
    print(f"\n{'engine, plain decoding':<24} {'tok/s':>8} {'target ms/step':>15} {'host ms/step':>13}")
    for e in engine:
        print(f"{e['path']:<24} {e['decode_tokens_per_s']:>8.1f} {e['target_ms_per_step']:>15.2f} "
              f"{e['host_ms_per_step']:>13.2f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/step_split.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.max_new_tokens, args.json_path)
