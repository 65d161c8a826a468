"""The `specvox` command line: up, serve, client, say, demo."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path

from services import SERVICE_MODULES

SERVICES = ("asr", "llm", "tts", "gateway")
START_ORDER = ("tts", "asr", "llm", "gateway")  # the gateway last: it calls the others


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specvox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="start Redis (embedded unless configured) and all four services on loopback")
    up_parser.add_argument("--tts-python", help="run the tts service with this interpreter (e.g. the Coqui env's, "
                                                ".venv-coqui/bin/python); default: settings.tts_python, else this one")
    up_parser.add_argument("--workers", type=_workers_arg, default={}, metavar="STAGE=N,...",
                           help="processes per stage, e.g. llm=2,tts=2 (default 1 each): named llm-0, llm-1, ..., "
                                "worker i on the stage's port + i * supervisor.worker_port_stride")
    up_parser.add_argument("--services", type=_services_arg, default=SERVICES, metavar="STAGE,...",
                           help="start only these stages (e.g. llm,tts for a second machine sharing the "
                                "first one's Redis); default: all four")
    serve = sub.add_parser("serve", help="start one service alone")
    serve.add_argument("service", choices=SERVICES)
    health = sub.add_parser("health", help="exit 0 if the service at ADDRESS says SERVING (grpc.health.v1, over the "
                                           "settings' TLS, with the service credential): a container health check")
    health.add_argument("address", help="host:port, or a service name (asr, llm, tts, gateway) for its address")
    client = sub.add_parser("client", help="stream a WAV to the gateway and save the reply")
    client.add_argument("--wav", required=True, help="16-bit PCM WAV, mono or stereo, 8-48 kHz")
    client.add_argument("--address", default="", help="gateway host:port (default: from settings)")
    client.add_argument("--out", default="out/client", help="folder for reply.wav, captions.vtt, report.json")
    client.add_argument("--no-realtime", action="store_true", help="send the audio as fast as possible")
    keys = sub.add_parser("keys", help="the gateway's API keys: add TENANT (prints the key once), list, revoke "
                                       "TENANT-or-HASH-PREFIX; only hashes are stored (docs/security.md)")
    keys.add_argument("action", choices=["add", "list", "revoke"])
    keys.add_argument("name", nargs="?", default="", help="add: the tenant; revoke: a tenant or a key's hash prefix")
    keys.add_argument("--file", default="", help="the key file (default: auth.keys_file)")
    say = sub.add_parser("say", help="synthesize text with the configured voice into a WAV file")
    say.add_argument("text")
    say.add_argument("--out", required=True)
    say.add_argument("--sample-rate", type=int, default=16_000)
    say.add_argument("--pad-s", type=float, default=0.5, help="silence before and after the speech")
    demo = sub.add_parser("demo", help="one spoken turn through `specvox up` and the client")
    demo.add_argument("--wav", help="your own question (default: one made with the bundled voice)")
    demo.add_argument("--out", default="out/demo")
    gen = sub.add_parser("generate", help="one reply from the LLM stage, in this process (no server)")
    gen.add_argument("--prompt", required=True, help="wrapped in the model's chat template as one user message")
    gen.add_argument("--drafter",
                     help="none, ngram, suffix, early-exit, quantized, draft (with llm.draft_model set), "
                          "or eagle / medusa (a head trained for the target: specvox train-draft)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--dtype", help="float32, bfloat16, float16 or float64 (default: llm.dtype)")
    gen.add_argument("--weights", choices=["auto", "dense", "int4-exact", "int4-q8", "int4"],
                     help="auto: int4-exact where it applies, else dense; "
                          "int4-exact: the GGUF's own 4-bit codes, float32 arithmetic (CPU, AVX2 or AVX-512); "
                          "int4-q8: the same codes on 8-bit activations, integer products (llama.cpp's arithmetic); "
                          "int4: 4-bit layer weights on a CPU, with --dtype bfloat16 (default: llm.weights)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")
    draft = sub.add_parser("train-draft", help="train a draft head (EAGLE or Medusa) on the target's own replies, "
                                               "offline; resumes from its work folder (pipeline/llm/train_draft.py)")
    draft.add_argument("--kind", choices=["eagle", "medusa"], default="eagle")
    draft.add_argument("--target", default="", help="the target model (default: llm.model)")
    draft.add_argument("--out", default="", help="the artifact's folder (default: pipeline/llm/heads/<target>-<kind>)")
    draft.add_argument("--work", default="", help="data shards and checkpoints (default: out/train-draft/<name>)")
    draft.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    draft.add_argument("--data-minutes", type=float, default=20.0, help="time budget for generating the data")
    draft.add_argument("--prompts", type=int, default=6000, help="templated corpus prompts (the budget may use fewer)")
    draft.add_argument("--self-prompts", type=int, default=1000,
                       help="user turns the target writes itself, beside the templated ones (0: none)")
    draft.add_argument("--steps", type=int, default=0, help="stop training after this many steps (0: no cap)")
    draft.add_argument("--epochs", type=int, default=3, help="passes over the data (the time budget may stop sooner)")
    draft.add_argument("--device", help="default: llm.device")
    draft.add_argument("--dtype", default="", help="the target's dtype while it makes the data (default: llm.dtype)")
    draft.add_argument("--seed", type=int, default=0)
    draft.add_argument("--fresh", action="store_true", help="ignore an earlier run's checkpoint")
    draft.add_argument("--evaluate", type=int, default=0, metavar="N",
                       help="then decode the first N prompts of each benchmark set with the head (float32 engine)")
    draft.add_argument("--evaluate-only", action="store_true", help="evaluate the artifact at --out, no training")
    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench.add_argument("what", choices=["turn", "asr", "spec", "spec-plots", "step", "tts", "batch", "e2e",
                                        "end-of-turn", "fuzz", "soak", "faults", "lossless", "tts-allocator"])
    bench.add_argument("--drafter", default="suffix", help="spec-plots: the drafter swept over draft lengths")
    bench.add_argument("--out", default="docs", help="spec-plots, e2e, soak: folder for the PNGs (and JSON)")
    bench.add_argument("--turns", type=int, default=8,
                       help="turn, asr, e2e: spoken turns (e2e: each session's), or sentences per voice")
    bench.add_argument("--limit", type=int, default=16, help="spec: prompts per set")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="spec, batch: tokens per prompt")
    bench.add_argument("--workload", action="append", choices=["dialogue", "caption"],
                       help="spec: prompt sets in this order (repeatable; default dialogue then caption)")
    bench.add_argument("--sessions", help="batch, e2e, soak: concurrent session counts to measure "
                                          "(default 1,2,4,8; e2e 1,4; soak: one count, 4)")
    bench.add_argument("--backend", default="", help="tts: piper or coqui (default: tts.backend)")
    bench.add_argument("--token-ms", type=float, default=40.0, help="tts: a word of the reply every this many ms")
    bench.add_argument("--threads", type=int, default=0, help="tts: model threads (default: tts.threads)")
    bench.add_argument("--json", dest="json_path", help="write the rows here")
    bench.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                       help="asr: also replay each clip with these asr settings changed (repeatable)")
    bench.add_argument("--chunk-ms", type=int, default=100, help="asr: audio per chunk the replayed microphone sends")
    bench.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                       help="asr: time a feed by wall time, or by this process's CPU time (a busy machine)")
    bench.add_argument("--cases", type=int, default=200, help="fuzz: hypothesis cases per gRPC method")
    bench.add_argument("--seed", type=int, help="fuzz: hypothesis seed (default: a random one, printed)")
    bench.add_argument("--minutes", type=float, default=30.0,
                       help="soak: how long the conversations run; tts-allocator: how long each variant is hammered")
    bench.add_argument("--sample-s", type=float, default=5.0, help="soak: seconds between memory samples")
    bench.add_argument("--faults", type=int, default=20, help="faults: faults injected of each kind")
    bench.add_argument("--replies", type=int, default=400,
                       help="lossless: replies sampled per case (--limit: prompts, at most 2)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        _idle_threads_yield()  # before torch or ctranslate2 loads OpenMP

    from services.runtime import configure_logging
    from services.settings import Settings

    settings = Settings()
    if args.command == "serve" and argv is None:  # started as a command: it may start again, tuned
        from services.server import allocator

        allocator.exec_with_tunables(settings.malloc_mmap_threshold.get(args.service, 0), settings.malloc_huge_pages,
                                     settings.malloc_library.get(args.service, ""), args.service)
    configure_logging(os.environ.get("SPECVOX_LOG_LEVEL", "WARNING" if args.command == "client" else "INFO"),
                      settings.log_format, args.service if args.command == "serve" else "")
    if args.command == "keys":
        from services.server.auth import AuthConfigError, keys_command

        if args.action != "list" and not args.name:
            parser.error(f"keys {args.action} needs a tenant{' or a hash prefix' if args.action == 'revoke' else ''}")
        try:
            return keys_command(args.action, args.file or settings.auth.keys_file, args.name)
        except AuthConfigError as e:
            print(f"specvox keys: {e}", file=sys.stderr)
            return 2
    if args.command == "health":
        from services.server.supervisor import health_probe

        address = settings.address(args.address) if args.address in SERVICES else args.address
        serving = health_probe(settings)(address)
        print(f"{address}: {'SERVING' if serving else 'not serving'}")
        return 0 if serving else 1
    if args.command == "up":
        return up(settings, args.tts_python or settings.tts_python, args.services, args.workers)
    if args.command == "serve":
        return serve_one(settings, args.service)
    if args.command == "client":
        return run_client(settings, args)
    if args.command == "generate":
        try:
            return generate(settings, args)
        except ValueError as e:  # settings it cannot run, an unknown drafter, a prompt too long: said, not traced
            print(f"specvox generate: {e}", file=sys.stderr)
            return 2
    if args.command == "train-draft":
        return train_draft(settings, args)
    if args.command == "bench":
        if args.what == "spec-plots":
            from bench import spec_plots

            return spec_plots.run(settings, args.drafter, args.limit, args.max_new_tokens, args.out)
        if args.what == "tts":
            from bench import tts

            return tts.run(settings, args.backend, args.token_ms, args.threads, args.json_path)
        if args.what == "spec":
            from bench import spec

            return spec.run(settings, args.limit, args.max_new_tokens, args.json_path,
                            tuple(args.workload or ("dialogue", "caption")))
        if args.what == "step":
            from bench import step_split

            return step_split.run(settings, args.max_new_tokens, args.json_path)
        if args.what == "asr":
            from bench import asr

            return asr.run(settings, args.turns, args.json_path, args.variant, args.chunk_ms, args.clock)
        if args.what == "batch":
            from bench import batch

            sessions = tuple(int(n) for n in (args.sessions or "1,2,4,8").split(","))
            return batch.run(settings, args.max_new_tokens, args.json_path, sessions)
        if args.what == "end-of-turn":
            from bench import end_of_turn

            return end_of_turn.run(settings, args.json_path)
        if args.what == "e2e":
            from bench import e2e

            return e2e.run(settings, tuple(int(n) for n in (args.sessions or "1,4").split(",")), args.turns,
                           args.json_path, args.out)
        if args.what == "fuzz":
            from bench import fuzz

            return fuzz.run(settings, args.cases, args.json_path, args.seed)
        if args.what == "soak":
            from bench import soak

            return soak.run(settings, args.minutes, int(args.sessions or 4), args.json_path, args.out, args.sample_s)
        if args.what == "tts-allocator":
            from bench import tts_allocator

            return tts_allocator.run(settings, args.minutes, args.json_path)
        if args.what == "faults":
            from bench import faults

            return faults.run(settings, args.faults, args.json_path)
        if args.what == "lossless":
            from bench import lossless

            return lossless.run(settings, args.replies, args.json_path, prompts=args.limit)
        from bench import turn

        return turn.run(settings, args.turns, args.json_path)
    if args.command == "demo":
        from services.demo import run_demo

        return run_demo(settings, args.wav, args.out)
    return say_to_file(settings, args.text, args.out, args.sample_rate, args.pad_s)


def _workers_arg(text: str) -> dict[str, int]:
    from services.server.supervisor import parse_workers

    try:
        return parse_workers(text, SERVICES)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _services_arg(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in SERVICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: the stages are {', '.join(SERVICES)}")
    return names


def _idle_threads_yield() -> None:
    """A service's OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE) unless told otherwise.

    The services share a machine's cores (`specvox up` runs asr, llm and tts side by side), and
    OpenMP's default lets idle threads spin at every barrier: a spinning torch or CTranslate2
    thread holds a core another stage needs, and a stage whose thread lost its core waits at
    the barrier for it. On 2 cores with one kept busy, plain decoding ran at 2 tokens/s
    spinning and 8 passive (and a 52-token prefill took 2.1 s against 0.18). Alone on a
    quiet machine spinning is faster (12 against 9.5 tokens/s), so the one-process commands
    (generate, bench spec) keep OpenMP's default, and an OMP_WAIT_POLICY already set wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def kernel_threads_beside_other_stages(settings, env: dict[str, str]) -> None:
    """Under `specvox up` the llm shares the machine's cores with asr and tts, so its int4-exact
    kernels run on the calling thread unless `llm.kernel_threads` names a count (its 0, one per core,
    is for an llm with a machine to itself). Two kernel threads beside the other stages, 4 sessions
    on 2 cores (2026-12-05, docs/benchmarks.md): the budget missed in 19 of 72 turns against 12 on one."""
    if settings.llm.kernel_threads == 0:
        env.setdefault("SPECVOX_LLM__KERNEL_THREADS", "1")


def serve_one(settings, service: str) -> int:
    import importlib

    from services.grpc_server import ServiceExit, run_service, set_priority

    module = importlib.import_module(SERVICE_MODULES[service])
    set_priority(settings, service)
    try:
        asyncio.run(run_service(settings, module.build))
    except ServiceExit as e:  # a worker failed (its traceback logged where it did), or the port is taken
        print(f"specvox: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def up(settings, tts_python: str = "", stages: tuple[str, ...] = SERVICES,
       workers: dict[str, int] | None = None) -> int:
    """Run each service (or each of `stages`) as its own processes under services/server/supervisor.py:
    models load in parallel, no shared GIL, a crashed one restarted while the others serve.

    The tts service may run under another interpreter: the Coqui backend's environment
    cannot share this one's torch.
    """
    from services import protos
    from services.redis_store import _without_password, default_data_dir
    from services.runtime import start_embedded_redis
    from services.server import auth
    from services.server.supervisor import Supervisor, health_probe, plan_children

    workers = workers or {}
    pythons = {name: sys.executable for name in SERVICES}
    if tts_python:
        resolved = shutil.which(tts_python)
        if resolved is None:
            print(f"specvox: the tts interpreter {tts_python!r} does not exist (for the Coqui backend: make coqui)",
                  file=sys.stderr)
            return 2
        pythons["tts"] = resolved

    try:
        protos.require()  # said once here, not by four children failing alike
    except protos.ProtosNotBuiltError as e:
        print(f"specvox: {e}", file=sys.stderr)
        return 2
    embedded = None
    env = dict(os.environ)
    kernel_threads_beside_other_stages(settings, env)
    # Keys enforced at the gateway: asr, llm and tts take only the cluster's credential (generated once).
    cluster_auth, credential_env = auth.cluster_credential(
        settings.auth, Path(settings.redis.data_dir or default_data_dir()).parent)
    settings = settings.model_copy(update={"auth": cluster_auth})
    env.update(credential_env)

    def ready(children) -> None:
        print("specvox: all services ready", flush=True)
        for child in children:
            stage = child.name.rsplit("-", 1)[0]
            other = f"  ({pythons[stage]})" if pythons[stage] != sys.executable else ""
            print(f"  {child.name:<10} {child.address:<22} pid {child.pid}{other}", flush=True)
        print("  redis      " + (embedded.display_url if embedded else _without_password(str(settings.redis_url))),
              flush=True)
        print("specvox: a crashed service is restarted; Ctrl-C stops everything", flush=True)

    supervisor = Supervisor(settings.supervisor, settings.drain_grace_s, health_probe(settings), on_ready=ready)
    supervisor.catch_signals()  # from here a SIGTERM drains, and the Valkey below is stopped
    try:
        if not settings.redis_url:
            embedded = start_embedded_redis(settings)
            env["SPECVOX_REDIS_URL"] = embedded.url
            print(f"specvox: embedded Valkey at {embedded.display_url} (data in {embedded.data_dir})", flush=True)
        ports = {name: getattr(settings, f"{name}_port") for name in SERVICES}
        order = [name for name in START_ORDER if name in stages]
        children = plan_children(order, workers, env, pythons, ports, settings.host, settings.metrics_port,
                                 settings.supervisor)
        return supervisor.run(children)
    finally:
        if embedded:
            embedded.stop()
        print("specvox: stopped", flush=True)


def run_client(settings, args) -> int:
    from services.client import ClientOptions, converse, write_outputs
    from services.demo import print_summary

    options = ClientOptions(realtime=not args.no_realtime, max_message_bytes=settings.max_message_bytes,
                            api_key=settings.auth.api_key, tls=settings.tls)
    turns = asyncio.run(converse(args.address or settings.address("gateway"), args.wav, options))
    print_summary(write_outputs(turns, args.out), Path(args.out))
    return 0


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

    from bench.prompts import load_prompts
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


def say_to_file(settings, text: str, out: str, sample_rate_hz: int, pad_s: float) -> int:
    import numpy as np

    from pipeline.audio import float_to_pcm16, wav_bytes
    from pipeline.tts.backend import load_synthesizer
    from pipeline.tts.speech_text import speech_text

    audio = load_synthesizer(settings.tts).synthesize(speech_text(text).spoken, sample_rate_hz)  # as tts says it
    pad = np.zeros(int(pad_s * sample_rate_hz), np.float32)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "wb") as f:
        f.write(wav_bytes(float_to_pcm16(np.concatenate([pad, audio, pad])), sample_rate_hz))
    print(f"wrote {out} ({audio.size / sample_rate_hz:.2f} s of speech)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
