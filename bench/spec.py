"""`specvox bench spec`: speculative decoding against Hugging Face, same weights, dtype and lengths.

Rows per workload (the dialogue and caption sets of shared/data/prompts.json):
Hugging Face `generate()` greedy, Hugging Face prompt-lookup assisted generation, specvox
plain decoding (with its static KV cache, and with transformers' dynamic cache as a
control), and specvox with each drafter. Throughput is new tokens over wall time, summed
over the set; `identical_to_greedy` compares every output with HF greedy's. Requests carry
no session key, so the suffix drafter remembers nothing from one prompt to the next; only
the draft-length controller's statistics (acceptance by match length, verify cost) carry
over, as they do in the service.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.prompts import load_prompts
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import LlmOptions, load_draft_model, load_model
from pipeline.llm.prompts import Task, chat_messages, encode_chat

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


def run(settings, limit: int, max_new_tokens: int, json_path: str | None) -> int:
    prompts = load_prompts()
    loaded = load_model(settings.llm)
    generator = Generator(loaded, load_draft_model(settings.llm, loaded), settings.llm.early_exit_layers,
                          settings.llm.static_cache)
    dynamic = Generator(loaded, static_cache=False)
    methods = ["hf-greedy", "hf-prompt-lookup", "specvox-none-dynamic-cache",
               *[f"specvox-{d}" for d in generator.drafters]]
    print(f"torch threads {torch.get_num_threads()}, {settings.llm.dtype} on {settings.llm.device}", flush=True)
    _hf_generate(generator, list(loaded.tokenizer.encode("Hello")), 4, False)  # type: ignore[attr-defined]
    generator.warm_up()
    dynamic.warm_up()
    rows = []
    for workload in ("dialogue", "caption"):
        encoded = [encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, p)) for p in prompts[workload][:limit]]
        reference: list[list[int]] = []
        baseline = 0.0
        for method in methods:
            runner = dynamic if method == "specvox-none-dynamic-cache" else generator
            outputs, seconds, accepted_len = _measure(method, runner, encoded, max_new_tokens, settings.llm)
            if method == "hf-greedy":
                reference, baseline = outputs, sum(map(len, outputs)) / seconds
            tokens_per_s = sum(map(len, outputs)) / seconds
            rows.append({
                "workload": workload, "method": method, "prompts": len(encoded), "max_new_tokens": max_new_tokens,
                "dtype": settings.llm.dtype, "device": settings.llm.device,
                "tokens_per_s": round(tokens_per_s, 2), "speedup_vs_hf_greedy": round(tokens_per_s / baseline, 3),
                "mean_accepted_len": accepted_len, "identical_to_greedy": outputs == reference,
                "verify_cost_per_token": round(runner.verify_cost.per_token, 4),
                "torch_threads": torch.get_num_threads(),
            })
            print(f"  {workload:<9} {method:<27} {tokens_per_s:7.1f} tok/s", flush=True)
    print_table(rows)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def _measure(method: str, generator: Generator, prompts: list[list[int]], max_new: int, options: LlmOptions):
    outputs, seconds, steps, tokens = [], 0.0, 0, 0
    eos = generator.loaded.eos_token_ids
    for prompt in prompts:
        started = time.perf_counter()
        if method.startswith("hf-"):
            out = _hf_generate(generator, prompt, max_new, method == "hf-prompt-lookup")
        else:
            drafter = "none" if method == "specvox-none-dynamic-cache" else method.removeprefix("specvox-")
            request = GenerationRequest(tuple(prompt), max_new, drafter, max_draft_tokens=options.max_draft_tokens,
                                        adaptive_draft=options.adaptive_draft)
            out = [t for step in generator.steps(request) for t in step.token_ids]
            steps += generator.last_stats.steps
            tokens += generator.last_stats.new_tokens
        seconds += time.perf_counter() - started
        outputs.append([t for t in out if t not in eos])
    return outputs, seconds, (round(tokens / steps, 3) if steps else None)


@torch.inference_mode()
def _hf_generate(generator: Generator, prompt: list[int], max_new: int, prompt_lookup: bool) -> list[int]:
    loaded = generator.loaded
    ids = torch.tensor([prompt], device=loaded.device)
    extra = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS} if prompt_lookup else {}
    out = loaded.model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(loaded.eos_token_ids),
                                pad_token_id=loaded.tokenizer.pad_token_id or 0, **extra)  # type: ignore[attr-defined]
    return out[0, len(prompt):].tolist()


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':<9} {'method':<27} {'tok/s':>8} {'vs HF greedy':>13} {'accepted/step':>14} {'identical':>10}")
    for r in rows:
        accepted = "" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"
        print(f"{r['workload']:<9} {r['method']:<27} {r['tokens_per_s']:>8.1f} {r['speedup_vs_hf_greedy']:>12.2f}x "
              f"{accepted:>14} {str(r['identical_to_greedy']):>10}")
