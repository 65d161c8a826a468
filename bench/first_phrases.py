"""First phrases first: a new reply's first tokens beside replies already far along, parked or not.

    python -m bench.first_phrases [--json PATH]

Three replies are decoded `--ahead` steps into their answers in one BatchedDecoder; then a
new reply joins and the clock runs until it has `--tokens` tokens (its prefill included),
with parking off (`urgent_tokens=0`) and on (the settings' `llm.urgent_tokens`,
`llm.park_min_tokens`), alternating, each new prompt once per round. Prints a table and
writes JSON; the settings are the service's (int4-exact where the CPU has it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pipeline.llm.batch import BatchedDecoder
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import load_model
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from services.settings import Settings

ALONG = ("Tell me about the history of Rome.", "Explain how rainbows form.", "Describe a day at the beach.")
NEW = ("What is the tallest mountain in the world?", "Why do cats purr?", "How do airplanes fly?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/first_phrases.json",
                        help="write the result here (default: %(default)s, the current figures)")
    parser.add_argument("--ahead", type=int, default=30, help="steps the three replies run before the new one")
    parser.add_argument("--tokens", type=int, default=10, help="the new reply's tokens to wait for")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = Settings()
    o = settings.llm
    loaded = load_model(o)
    generator = Generator.from_options(loaded, o)
    generator.warm_up(drafters=("none", o.drafter))

    def encode(text: str) -> tuple[int, ...]:
        return tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))

    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for name, urgent in (("off", 0), ("on", o.urgent_tokens)):
            for text in NEW:
                decoder = BatchedDecoder(generator, o.max_batch_size, urgent_tokens=urgent,
                                         park_min_tokens=o.park_min_tokens)
                for along in ALONG:
                    decoder.add(GenerationRequest(encode(along), 400, o.drafter))
                for _ in range(args.ahead):
                    decoder.step()
                started = time.perf_counter()
                row, got = decoder.add(GenerationRequest(encode(text), 400, o.drafter)), 0
                while got < args.tokens:
                    got += sum(len(step.token_ids) for r, step in decoder.step() if r is row)
                times[name].append((time.perf_counter() - started) * 1000)
                print(f"  parking {name}: {times[name][-1]:.0f} ms", flush=True)
    summary = {name: {"median_ms": round(statistics.median(v)), "runs": [round(t) for t in v]}
               for name, v in times.items()}
    print(f"\nnew reply's first {args.tokens} tokens beside 3 replies {args.ahead} steps along "
          f"({loaded.weights}, drafter {o.drafter})")
    print("| parking | median ms | runs |\n|---|---:|---:|")
    for name, row in summary.items():
        print(f"| {name} | {row['median_ms']} | {len(row['runs'])} |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"weights": loaded.weights, "drafter": o.drafter, "ahead_steps": args.ahead,
                       "tokens": args.tokens, "urgent_tokens": o.urgent_tokens,
                       "park_min_tokens": o.park_min_tokens, **summary}, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
