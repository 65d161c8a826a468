"""`specvox bench spec`: speculative decoding against Hugging Face, same weights, dtype and lengths.

Rows per workload (the dialogue and caption sets of shared/data/prompts.json):
Hugging Face `generate()` greedy, Hugging Face prompt-lookup assisted generation, llama.cpp's
generation rate on the target's own GGUF file and the same thread count, measured by llama.cpp's
own `llama-bench` binary (`llama.cpp`: `bash bench/build_llama_bench.sh` builds it from the llama.cpp
vendored in the pinned llama-cpp-python sdist; `SPECVOX_LLAMA_BENCH` names another), greedy on the
same file through llama-cpp-python's Python generation loop (`llama-cpp-python generate loop`, the
`llamacpp` extra: a second, slower figure for the same library, whose loop costs per token what the
binary does not), each row reported as missing, with the reason, where it cannot run; specvox
plain decoding (through the lean Llama pass where the target has one, and through
transformers' own modules as a control: `specvox-none-transformers`; where the lean pass
replays its one-token steps as CUDA graphs, also without them: `specvox-none-eager`), and specvox with
each drafter, the ngram and suffix drafters and the trained heads also with their branches
verified as token trees (`specvox-ngram-tree`, `specvox-suffix-tree`, `specvox-eagle-tree`:
`llm.draft_branches`, or 3). Throughput is new
tokens over wall time, summed over the set; `identical_to_greedy` compares every output with HF greedy's and
`identical_to_plain` with specvox plain decoding's (the reference in a configuration HF
does not run, such as `llm.weights=int4`). Outside float32 (`llm.weights=int4` with
bfloat16) the run also times HF greedy on the float32 target (`hf-greedy-float32`), the
goal's baseline, and reports `speedup_vs_hf_greedy_float32`; in float32 HF greedy already
runs on the float32 weights (with `llm.weights=int4-exact` too: the codes are the same
weights). Requests carry
no session key, so the suffix drafter remembers nothing from one prompt to the next; only
the draft-length controller's statistics (acceptance by match length, verify cost) carry
over, as they do in the service.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.exact_codes import _cpu_flags, kernel_threads
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from pipeline.models import resolve_llm

FLOAT32_BASELINE = "hf-greedy-float32"  # HF greedy on the float32 target, when the run is in another configuration
HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens
CONTROL_METHOD = "specvox-none-transformers"  # plain decoding through transformers' modules
EAGER_METHOD = "specvox-none-eager"  # plain decoding through the lean pass without CUDA graphs (a GPU's control)
LLAMA_CPP = "llama.cpp"  # llama.cpp's own llama-bench on the same GGUF and thread count (its generation rate)
LLAMA_CPP_PYTHON = "llama-cpp-python generate loop"  # greedy on the same GGUF through llama-cpp-python's loop
LLAMA_BENCH_ENV = "SPECVOX_LLAMA_BENCH"  # the llama-bench binary, where it is not at bench/build_llama_bench.sh's
LLAMA_BENCH_BUILT = Path("build/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench")
TREE = "-tree"  # a drafter's row with its branches verified as a token tree (model-free drafters, heads)
TREE_BRANCHES = 3  # the tree rows' branches where llm.draft_branches is 0


def run(settings, limit: int, max_new_tokens: int, json_path: str | None,
        workloads: tuple[str, ...] = ("dialogue", "caption"), llama_bench_path: str | None = None) -> int:
    prompts = load_prompts()
    loaded = load_model(settings.llm)
    generator = Generator.from_options(loaded, settings.llm)
    control = Generator(loaded, static_cache=settings.llm.static_cache, lean=False)
    eager = None
    if loaded.lean is not None and loaded.lean.graphed is not None:
        eager = Generator(dataclasses.replace(loaded, lean=loaded.lean.eager()), static_cache=settings.llm.static_cache)
    float32 = None
    if settings.llm.dtype != "float32":
        float32 = Generator(load_model(dataclasses.replace(settings.llm, dtype="float32", weights="dense",
                                                           lean_forward=False)))
    llama_bench, llama_bench_missing = LlamaBench.for_target(settings.llm.model, max_new_tokens, llama_bench_path)
    llama_cpp, llama_cpp_missing = LlamaCpp.for_target(settings.llm.model, loaded.context_tokens)
    missing = {method: why for method, why in ((LLAMA_CPP, llama_bench_missing),
                                               (LLAMA_CPP_PYTHON, llama_cpp_missing)) if why}
    methods = ["hf-greedy", *([FLOAT32_BASELINE] if float32 else []), "hf-prompt-lookup",
               *([LLAMA_CPP] if llama_bench else []), *([LLAMA_CPP_PYTHON] if llama_cpp else []),
               CONTROL_METHOD, *([EAGER_METHOD] if eager else []),
               *[f"specvox-{d}" for d in generator.drafters],
               *[f"specvox-{d}{TREE}" for d in ("ngram", "suffix", *generator.draft_heads)]]
    print(f"torch threads {torch.get_num_threads()}, kernel threads {kernel_threads()}, {settings.llm.dtype} on "
          f"{settings.llm.device}", flush=True)
    runners = {CONTROL_METHOD: control, **({FLOAT32_BASELINE: float32} if float32 else {}),
               **({EAGER_METHOD: eager} if eager else {})}
    for hf_runner in (generator, *([float32] if float32 else [])):
        _hf_generate(hf_runner, list(loaded.tokenizer.encode("Hello")), 4, False)  # type: ignore[attr-defined]
    generator.warm_up(drafters=generator.drafters)
    control.warm_up()
    if eager:
        eager.warm_up()
    if llama_cpp:
        llama_cpp.greedy(list(loaded.tokenizer.encode("Hello")), 4, loaded.eos_token_ids)  # type: ignore[attr-defined]
    if loaded.device.type == "cuda":  # CUDA loads a kernel at its first use: one untimed round on a real prompt
        first = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, prompts[workloads[0]][0]))
        for method in methods:
            if method != LLAMA_CPP:  # a process of its own, which warms itself up
                _measure(method, runners.get(method, generator), first, 16, settings.llm, llama_cpp)
    rows = []
    for workload in workloads:
        encoded = [encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, p)) for p in prompts[workload][:limit]]
        runs = {method: _Tally() for method in methods}
        for i, prompt in enumerate(encoded):  # every method on one prompt, then the next: load drifts alike
            # and in reverse order every other prompt, so a method's place in the round (after the HF
            # baselines' allocations, say) weighs on every method alike
            for method in methods if i % 2 == 0 else methods[::-1]:
                if method == LLAMA_CPP:
                    assert llama_bench is not None
                    runs[method].add_generated(*llama_bench.generate())
                    continue
                runner = runners.get(method, generator)
                runs[method].add(*_measure(method, runner, prompt, max_new_tokens, settings.llm, llama_cpp))
            print(f"  {workload} prompt {i + 1}/{len(encoded)}: " + ", ".join(
                f"{m.removeprefix('specvox-')} {t.tokens_per_s:.1f}" for m, t in runs.items())
                + "; all identical so far: "
                + str(all(t.outputs == runs["hf-greedy"].outputs for m, t in runs.items()
                          if m not in (LLAMA_CPP, LLAMA_CPP_PYTHON))),
                flush=True)
        baseline, reference = runs["hf-greedy"].tokens_per_s, runs["hf-greedy"].outputs
        float32_baseline = runs[FLOAT32_BASELINE].tokens_per_s if float32 else baseline
        llama_cpp_rate = runs[LLAMA_CPP].tokens_per_s if llama_bench else None
        llama_cpp_python_rate = runs[LLAMA_CPP_PYTHON].tokens_per_s if llama_cpp else None
        for method, tally in runs.items():
            runner = runners.get(method, generator)
            text = method != LLAMA_CPP  # llama-bench times its tokens and returns none of them
            rows.append({
                "workload": workload, "method": method, "prompts": len(encoded), "max_new_tokens": max_new_tokens,
                "dtype": settings.llm.dtype, "device": settings.llm.device,
                "tokens_per_s": round(tally.tokens_per_s, 2),
                "speedup_vs_hf_greedy": round(tally.tokens_per_s / baseline, 3),
                "mean_accepted_len": round(tally.tokens / tally.steps, 3) if tally.steps else None,
                "speedup_vs_hf_greedy_float32": round(tally.tokens_per_s / float32_baseline, 3),
                "speedup_vs_llama_cpp": round(tally.tokens_per_s / llama_cpp_rate, 3) if llama_cpp_rate else None,
                "speedup_vs_llama_cpp_python": (round(tally.tokens_per_s / llama_cpp_python_rate, 3)
                                                if llama_cpp_python_rate else None),
                "identical_to_greedy": tally.outputs == reference if text else None,
                "identical_to_plain": tally.outputs == runs["specvox-none"].outputs if text else None,
                "weights": "gguf (llama.cpp)" if method in (LLAMA_CPP, LLAMA_CPP_PYTHON) else runner.loaded.weights,
                "verify_cost_per_token": (None if method in (LLAMA_CPP, LLAMA_CPP_PYTHON)
                                          else round(runner.verify_cost.per_token, 4)),
                "torch_threads": torch.get_num_threads(),
                "kernel_threads": kernel_threads(),
                **(llama_bench.describe() if method == LLAMA_CPP and llama_bench else {}),
            })
        for method, why in missing.items():  # said in the table and the JSON, not dropped
            rows.append({"workload": workload, "method": method, "prompts": len(encoded), "tokens_per_s": None,
                         "missing": why})
        if json_path:  # after each set, so a long run that is stopped keeps what it finished
            Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
    print_table(rows)
    if json_path:
        print(f"wrote {json_path}")
    return 0


@dataclass
class _Tally:
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0  # target passes (specvox methods only)
    tokens: int = 0
    generated: int = 0  # tokens timed without their text (llama-bench)

    def add(self, output: list[int], seconds: float, steps: int, tokens: int) -> None:
        self.outputs.append(output)
        self.seconds += seconds
        self.steps += steps
        self.tokens += tokens

    def add_generated(self, tokens: int, seconds: float) -> None:
        self.generated += tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float:
        return (sum(map(len, self.outputs)) + self.generated) / self.seconds if self.seconds else 0.0


def _measure(method: str, generator: Generator, prompt: list[int], max_new: int, options: LlmOptions,
             llama_cpp: LlamaCpp | None = None) -> tuple[list[int], float, int, int]:
    """(output without EOS, seconds, target passes, committed tokens) for one prompt."""
    steps = tokens = 0
    started = time.perf_counter()
    if method == LLAMA_CPP_PYTHON:
        assert llama_cpp is not None
        out = llama_cpp.greedy(prompt, max_new, generator.loaded.eos_token_ids)
    elif method.startswith("hf-"):
        out = _hf_generate(generator, prompt, max_new, method == "hf-prompt-lookup")
    else:
        plain = method in (CONTROL_METHOD, EAGER_METHOD)
        drafter = "none" if plain else method.removeprefix("specvox-").removesuffix(TREE)
        branches = (options.draft_branches or TREE_BRANCHES) if method.endswith(TREE) else 0
        request = GenerationRequest(tuple(prompt), max_new, drafter, max_draft_tokens=options.max_draft_tokens,
                                    adaptive_draft=options.adaptive_draft, draft_branches=branches)
        out = [t for step in generator.steps(request) for t in step.token_ids]
        steps, tokens = generator.last_stats.steps, generator.last_stats.new_tokens
    seconds = time.perf_counter() - started
    return [t for t in out if t not in generator.loaded.eos_token_ids], seconds, steps, tokens


@torch.inference_mode()
def _hf_generate(generator: Generator, prompt: list[int], max_new: int, prompt_lookup: bool) -> list[int]:
    loaded = generator.loaded
    ids = torch.tensor([prompt], device=loaded.device)
    extra = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS} if prompt_lookup else {}
    out = loaded.model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(loaded.eos_token_ids),
                                pad_token_id=loaded.tokenizer.pad_token_id or 0, **extra)  # type: ignore[attr-defined]
    return out[0, len(prompt):].tolist()


class LlamaBench:
    """llama.cpp's own generation rate on the target's GGUF file: its `llama-bench` binary.

    `llama-bench -m GGUF -p 0 -n N -t THREADS -r 1 -o json`, once in each prompt's round of
    methods, so that load drifts weigh on it as on the others: N tokens generated one pass at a
    time from an empty context, timed inside the binary after its one-token warm-up, with no
    Python around the loop. It stops at no end-of-sequence token and prefills no prompt, where
    the other rows pay each prompt's prefill, so the comparison leans llama.cpp's way. llama.cpp's
    own defaults, its repacked weights (extra buffer types) included: on an Intel Xeon with AMX
    (2026-12-06) they decoded one-token passes about twice as fast as without (`--repack 0`), while a
    pass of two tokens or more died there (SIGILL), which is why the llama-cpp-python row (below)
    loads without them. The same file and thread count as that row, whose loop adds Python's cost
    per token to the same library's.
    """

    def __init__(self, binary: str, gguf: str, threads: int, tokens: int) -> None:
        self.argv = [binary, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1", "-o", "json"]
        self.build: dict = {}

    @classmethod
    def for_target(cls, model: str, tokens: int, binary: str | None = None) -> tuple[LlamaBench | None, str]:
        """The runner, or None and why the row is missing."""
        binary = binary or os.environ.get(LLAMA_BENCH_ENV) or (
            str(LLAMA_BENCH_BUILT) if LLAMA_BENCH_BUILT.is_file() else shutil.which("llama-bench"))
        if not binary or not os.access(binary, os.X_OK):
            why = (f"no llama-bench binary{f' at {binary}' if binary else ''} (bash bench/build_llama_bench.sh "
                   f"builds it; {LLAMA_BENCH_ENV}=PATH names one)")
            print(f"{LLAMA_CPP} row missing: {why}", flush=True)
            return None, why
        ref = resolve_llm(model)
        if not ref.gguf_file:
            why = f"the target {model!r} is not a GGUF file"
            print(f"{LLAMA_CPP} row missing: {why}", flush=True)
            return None, why
        return cls(binary, str(Path(ref.name_or_path) / ref.gguf_file), torch.get_num_threads(), tokens), ""

    def generate(self) -> tuple[int, float]:
        """(tokens generated, seconds), as the binary timed them."""
        done = subprocess.run(self.argv, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout)[0]
        self.build = {key: result.get(key) for key in ("build_commit", "build_number", "cpu_info", "backends",
                                                      "n_threads", "type_k", "model_type", "repack")}
        return int(result["n_gen"]), sum(result["samples_ns"]) / 1e9

    def describe(self) -> dict:
        """What a row records of the run: the command (the model's folder left out) and llama.cpp's build."""
        argv = [Path(self.argv[0]).name, *self.argv[1:]]
        argv[2] = Path(argv[2]).name
        return {"command": " ".join(argv), "llama_cpp": self.build}


class LlamaCpp:
    """llama.cpp greedy decoding of the target's own GGUF file, through llama-cpp-python's Python
    generation loop (`Llama.generate`: a Python call, a sampler and a logits copy per token).

    The same file the bundled target loads from (transformers dequantizes it; llama.cpp runs its
    Q4_1 and Q8_0 codes with 8-bit activations, so its tokens may differ from float32's where
    rounding decides), the same prompt token ids (the file's vocabulary is the tokenizer's), the
    same torch thread count, and the same stopping tokens. Each prompt starts from an empty
    cache (`reset`), as every other method does.
    """

    def __init__(self, gguf: str, threads: int, context_tokens: int) -> None:
        from llama_cpp import Llama

        with _without_amx_buffers():
            self.llm = Llama(model_path=gguf, n_ctx=context_tokens, n_threads=threads, n_threads_batch=threads,
                             verbose=False)

    @classmethod
    def for_target(cls, model: str, context_tokens: int) -> tuple[LlamaCpp | None, str]:
        """The runner, or None and why the row is missing."""
        if importlib.util.find_spec("llama_cpp") is None:
            why = ("llama-cpp-python is not installed (pip install -e '.[llamacpp]'; it compiles llama.cpp, "
                   "~8 minutes on 2 cores)")
        elif not resolve_llm(model).gguf_file:
            why = f"the target {model!r} is not a GGUF file"
        else:
            ref = resolve_llm(model)
            return cls(str(Path(ref.name_or_path) / ref.gguf_file), torch.get_num_threads(), context_tokens), ""
        print(f"{LLAMA_CPP_PYTHON} row missing: {why}", flush=True)
        return None, why

    def greedy(self, prompt: list[int], max_new: int, eos: frozenset[int]) -> list[int]:
        self.llm.reset()
        out: list[int] = []
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            if token in eos:
                break
            out.append(int(token))
            if len(out) >= max_new:
                break
        return out


@contextlib.contextmanager
def _without_amx_buffers() -> Iterator[None]:
    """On a CPU that reports AMX, llama.cpp loads with no extra buffer types. llama-cpp-python 0.3.36,
    built with GGML_NATIVE on an Intel Xeon reporting amx_int8 (2026-12-05), put the Q4_1 matrices in
    ggml's AMX buffer type, whose product crashed the process (SIGSEGV in ggml_backend_amx_mul_mat) on
    every pass of two tokens or more. Extra buffer types only repack weights for kernels of their own
    (AMX, or Q4_0's 8×8 layout); without them llama.cpp runs its AVX-512/AVX2 vec_dot kernels on the
    file's blocks, as on any CPU without AMX."""
    from llama_cpp import llama_cpp  # the bindings module, whose defaults `Llama` reads

    if "amx_int8" not in _cpu_flags():
        yield
        return
    default = llama_cpp.llama_model_default_params

    def without_extra_buffers():  # noqa: ANN202 - llama_cpp's ctypes struct
        params = default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = default


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':<9} {'method':<30} {'tok/s':>8} {'vs HF greedy':>13} {'vs HF fp32':>11} "
          f"{'vs llama.cpp':>13} {'accepted/step':>14} {'= HF greedy':>12} {'= plain':>8}")
    for r in rows:
        if r.get("missing"):
            print(f"{r['workload']:<9} {r['method']:<30} missing: {r['missing']}")
            continue
        accepted = "" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"
        versus = "" if r.get("speedup_vs_llama_cpp") is None else f"{r['speedup_vs_llama_cpp']:.2f}x"
        print(f"{r['workload']:<9} {r['method']:<30} {r['tokens_per_s']:>8.1f} {r['speedup_vs_hf_greedy']:>12.2f}x "
              f"{r['speedup_vs_hf_greedy_float32']:>10.2f}x {versus:>13} {accepted:>14} "
              f"{_shown(r['identical_to_greedy']):>12} {_shown(r['identical_to_plain']):>8}")


def _shown(identical: bool | None) -> str:
    return "" if identical is None else str(identical)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--workload", action="append", choices=["dialogue", "caption"],
                        help="prompt sets in this order (repeatable; default dialogue then caption)")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/spec.json",
                        help="write the rows here (default: %(default)s, the current figures)")
    parser.add_argument("--llama-bench", metavar="PATH",
                        help=f"llama.cpp's llama-bench binary for the llama.cpp row (default: ${LLAMA_BENCH_ENV}, "
                             f"then {LLAMA_BENCH_BUILT}, which bench/build_llama_bench.sh builds, then PATH)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    workloads = tuple(args.workload or ("dialogue", "caption"))
    return run(settings, args.limit, args.max_new_tokens, args.json_path, workloads, args.llama_bench)
