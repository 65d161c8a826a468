"""`specvox generate` (one reply from the LLM stage, in this process) and `specvox train-draft`
(a draft head trained on the target's own replies)."""

from __future__ import annotations

import argparse
import sys

from services.cli.command import Command


def generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="wrapped in the model's chat template as one user message")
    parser.add_argument("--drafter",
                        help="none, ngram, suffix, early-exit, quantized, draft (with llm.draft_model set), "
                             "or eagle / medusa (a head trained for the target: specvox train-draft)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dtype", help="float32, bfloat16, float16 or float64 (default: llm.dtype)")
    parser.add_argument("--weights", choices=["auto", "dense", "int4-exact", "int4-q8", "int4"],
                        help="auto: int4-exact where it applies, else dense; "
                             "int4-exact: the GGUF's own 4-bit codes, float32 arithmetic (CPU, AVX2 or AVX-512); "
                             "int4-q8: the same codes on 8-bit activations, integer products (llama.cpp's "
                             "arithmetic); int4: 4-bit layer weights on a CPU, with --dtype bfloat16 "
                             "(default: llm.weights)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")


def run_generate(settings, args: argparse.Namespace) -> int:
    try:
        return generate(settings, args)
    except ValueError as e:  # settings it cannot run, an unknown drafter, a prompt too long: said, not traced
        print(f"specvox generate: {e}", file=sys.stderr)
        return 2


def train_draft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["eagle", "medusa"], default="eagle")
    parser.add_argument("--target", default="", help="the target model (default: llm.model)")
    parser.add_argument("--out", default="", help="the artifact's folder (default: pipeline/llm/heads/<target>-<kind>)")
    parser.add_argument("--work", default="", help="data shards and checkpoints (default: out/train-draft/<name>)")
    parser.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    parser.add_argument("--data-minutes", type=float, default=20.0, help="time budget for generating the data")
    parser.add_argument("--prompts", type=int, default=6000,
                        help="templated corpus prompts (the budget may use fewer)")
    parser.add_argument("--self-prompts", type=int, default=1000,
                        help="user turns the target writes itself, beside the templated ones (0: none)")
    parser.add_argument("--steps", type=int, default=0, help="stop training after this many steps (0: no cap)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="passes over the data (the time budget may stop sooner)")
    parser.add_argument("--device", help="default: llm.device")
    parser.add_argument("--dtype", default="", help="the target's dtype while it makes the data (default: llm.dtype)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="ignore an earlier run's checkpoint")
    parser.add_argument("--evaluate", type=int, default=0, metavar="N",
                        help="then decode the first N prompts of each benchmark set with the head (float32 engine)")
    parser.add_argument("--evaluate-only", action="store_true", help="evaluate the artifact at --out, no training")


def generate(settings, args) -> int:
    import dataclasses
    import json

    from pipeline.llm.engine import GenerationRequest, Generator
    from pipeline.llm.model import load_model
    from pipeline.llm.options import SamplingOptions
    from pipeline.llm.prompts import Task, chat_messages, encode_chat

    options = dataclasses.replace(settings.llm, dtype=args.dtype or settings.llm.dtype,
                                  weights=args.weights or settings.llm.weights)
    loaded = load_model(options)
    generator = Generator.from_options(loaded, options)
    prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, args.prompt))
    sampling = SamplingOptions(args.temperature, args.top_k, args.top_p, seed=args.seed).validate()
    request = GenerationRequest(tuple(prompt), args.max_new_tokens, args.drafter or options.drafter, sampling,
                                max_draft_tokens=options.max_draft_tokens, adaptive_draft=options.adaptive_draft,
                                draft_branches=options.draft_branches)
    token_ids, text = [], ""
    for step in generator.steps(request):
        token_ids += step.token_ids
        text += step.text_delta
        if not args.json:
            print(step.text_delta, end="", flush=True)
    stats = generator.last_stats.as_dict()
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "drafter": request.drafter, "stats": stats}))
    else:
        print(f"\n[{stats['new_tokens']} tokens, {stats['steps']} steps, "
              f"mean accepted length {stats['mean_accepted_len']}]", file=sys.stderr)
    return 0


def train_draft(settings, args) -> int:
    import json

    from pipeline.llm.prompt_sets import load_prompts
    from pipeline.llm.train_draft import TrainOptions, evaluate, train

    options = TrainOptions(kind=args.kind, target=args.target or settings.llm.model, out=args.out, work=args.work,
                           device=args.device or settings.llm.device, data_dtype=args.dtype or settings.llm.dtype,
                           threads=settings.llm.torch_threads, seed=args.seed, prompts=args.prompts,
                           self_prompts=args.self_prompts,
                           data_minutes=args.data_minutes, minutes=args.minutes, steps=args.steps, epochs=args.epochs,
                           fresh=args.fresh)
    benchmark = load_prompts()  # never trained on: the corpus is checked against them
    if not args.evaluate_only:
        card = train(options, excluded=[*benchmark["dialogue"], *benchmark["caption"]])
        print(json.dumps({k: card[k] for k in ("kind", "data", "heldout", "total_s")}, indent=2))
    if args.evaluate or args.evaluate_only:
        print(json.dumps(evaluate(options, benchmark, args.evaluate or 16), indent=2))
    return 0


COMMANDS = (
    Command("generate", "one reply from the LLM stage, in this process (no server)", generate_arguments,
            run_generate),
    Command("train-draft", "train a draft head (EAGLE or Medusa) on the target's own replies, offline; resumes "
                           "from its work folder (pipeline/llm/train_draft.py)", train_draft_arguments, train_draft),
)
