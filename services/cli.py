"""The `specvox` command line: up, serve, client, say, demo."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SERVICES = ("asr", "llm", "tts", "gateway")
START_ORDER = ("tts", "asr", "llm", "gateway")  # the gateway last: it calls the others


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specvox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="start Redis (embedded unless configured) and all four services on loopback")
    up_parser.add_argument("--tts-python", help="run the tts service with this interpreter (e.g. the Coqui env's, "
                                                ".venv-coqui/bin/python); default: settings.tts_python, else this one")
    serve = sub.add_parser("serve", help="start one service alone")
    serve.add_argument("service", choices=SERVICES)
    client = sub.add_parser("client", help="stream a WAV to the gateway and save the reply")
    client.add_argument("--wav", required=True, help="16-bit PCM WAV, mono or stereo, 8-48 kHz")
    client.add_argument("--address", default="", help="gateway host:port (default: from settings)")
    client.add_argument("--out", default="out/client", help="folder for reply.wav, captions.vtt, report.json")
    client.add_argument("--no-realtime", action="store_true", help="send the audio as fast as possible")
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
                     help="none, ngram, suffix, early-exit, quantized, or draft (with llm.draft_model set)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--dtype", help="float32, bfloat16, float16 or float64 (default: llm.dtype)")
    gen.add_argument("--weights", choices=["auto", "dense", "int4-exact", "int4"],
                     help="auto: int4-exact where it applies, else dense; "
                          "int4-exact: the GGUF's own 4-bit codes, float32 arithmetic (CPU, AVX-512); "
                          "int4: 4-bit layer weights on a CPU, with --dtype bfloat16 (default: llm.weights)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")
    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench.add_argument("what", choices=["turn", "asr", "spec", "spec-plots", "tts", "batch", "e2e",
                                        "end-of-turn"])
    bench.add_argument("--drafter", default="suffix", help="spec-plots: the drafter swept over draft lengths")
    bench.add_argument("--out", default="docs", help="spec-plots, e2e: folder for the PNGs (and JSON)")
    bench.add_argument("--turns", type=int, default=8,
                       help="turn, asr, e2e: spoken turns (e2e: each session's), or sentences per voice")
    bench.add_argument("--limit", type=int, default=16, help="spec: prompts per set")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="spec, batch: tokens per prompt")
    bench.add_argument("--workload", action="append", choices=["dialogue", "caption"],
                       help="spec: prompt sets in this order (repeatable; default dialogue then caption)")
    bench.add_argument("--sessions", help="batch, e2e: concurrent session counts to measure (default 1,2,4,8; e2e 1,4)")
    bench.add_argument("--backend", default="", help="tts: piper or coqui (default: tts.backend)")
    bench.add_argument("--token-ms", type=float, default=40.0, help="tts: a word of the reply every this many ms")
    bench.add_argument("--threads", type=int, default=0, help="tts: model threads (default: tts.threads)")
    bench.add_argument("--json", dest="json_path", help="write the rows here")
    bench.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                       help="asr: also replay each clip with these asr settings changed (repeatable)")
    bench.add_argument("--chunk-ms", type=int, default=100, help="asr: audio per chunk the replayed microphone sends")
    bench.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                       help="asr: time a feed by wall time, or by this process's CPU time (a busy machine)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        _idle_threads_yield()  # before torch or ctranslate2 loads OpenMP

    from services.runtime import configure_logging
    from services.settings import Settings

    configure_logging(os.environ.get("SPECVOX_LOG_LEVEL", "WARNING" if args.command == "client" else "INFO"))
    settings = Settings()
    if args.command == "up":
        return up(settings, args.tts_python or settings.tts_python)
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
        from bench import turn

        return turn.run(settings, args.turns, args.json_path)
    if args.command == "demo":
        from services.demo import run_demo

        return run_demo(settings, args.wav, args.out)
    return say_to_file(settings, args.text, args.out, args.sample_rate, args.pad_s)


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


def serve_one(settings, service: str) -> int:
    import importlib

    module = importlib.import_module(f"services.{service}_service")
    asyncio.run(module.run(settings))
    return 0


def up(settings, tts_python: str = "") -> int:
    """Run every service as its own process (models load in parallel, no shared GIL).

    The tts service may run under another interpreter: the Coqui backend's environment
    cannot share this one's torch.
    """
    from services import protos
    from services.redis_store import EmbeddedRedis

    pythons = {name: sys.executable for name in SERVICES}
    if tts_python:
        resolved = shutil.which(tts_python)
        if resolved is None:
            print(f"specvox: the tts interpreter {tts_python!r} does not exist (for the Coqui backend: make coqui)",
                  file=sys.stderr)
            return 2
        pythons["tts"] = resolved

    if protos.is_stale():  # once here, not in four children racing to write the same files
        protos.build()
    embedded = None
    env = dict(os.environ)
    if not settings.redis_url:
        embedded = EmbeddedRedis().start()
        env["SPECVOX_REDIS_URL"] = embedded.url
        print(f"specvox: embedded Valkey at {embedded.url}", flush=True)
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        for name in START_ORDER:
            children[name] = subprocess.Popen([pythons[name], "-m", "services.cli", "serve", name], env=env)
        if not _wait_healthy(settings, children, lambda: stopping):
            return 1
        print("specvox: all services ready", flush=True)
        for name in SERVICES:
            other = f"  ({pythons[name]})" if pythons[name] != sys.executable else ""
            print(f"  {name:<8} {settings.address(name)}{other}", flush=True)
        print("  redis    " + (embedded.url if embedded else str(settings.redis_url)), flush=True)
        print("specvox: Ctrl-C stops everything", flush=True)
        while not stopping:
            for name, child in children.items():
                if child.poll() is not None:
                    print(f"specvox: {name} exited with {child.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_children(children)
        if embedded:
            embedded.stop()
        print("specvox: stopped", flush=True)


def _wait_healthy(settings, children, stopping, timeout_s: float = 300.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline, pending = time.monotonic() + timeout_s, set(children)
    while pending and not stopping():
        for name in sorted(pending):
            if children[name].poll() is not None:
                print(f"specvox: {name} failed to start (exit {children[name].returncode})", file=sys.stderr)
                return False
            with grpc.insecure_channel(settings.address(name)) as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                except grpc.RpcError:
                    continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                pending.discard(name)
        if time.monotonic() > deadline:
            print(f"specvox: not ready after {timeout_s:.0f} s: {', '.join(sorted(pending))}", file=sys.stderr)
            return False
        time.sleep(0.3)
    return not pending


def _stop_children(children: dict[str, subprocess.Popen]) -> None:
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for name, child in children.items():
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            print(f"specvox: {name} did not stop in 10 s; killing it", file=sys.stderr)
            child.kill()


def run_client(settings, args) -> int:
    from services.client import ClientOptions, converse, write_outputs
    from services.demo import print_summary

    options = ClientOptions(realtime=not args.no_realtime, max_message_bytes=settings.max_message_bytes)
    turns = asyncio.run(converse(args.address or settings.address("gateway"), args.wav, options))
    print_summary(write_outputs(turns, args.out), Path(args.out))
    return 0


def generate(settings, args) -> int:
    import dataclasses
    import json

    from pipeline.llm.engine import GenerationRequest, Generator
    from pipeline.llm.model import load_model
    from pipeline.llm.prompts import Task, chat_messages, encode_chat
    from pipeline.llm.sampling import SamplingOptions

    options = dataclasses.replace(settings.llm, dtype=args.dtype or settings.llm.dtype,
                                  weights=args.weights or settings.llm.weights)
    loaded = load_model(options)
    generator = Generator.from_options(loaded, options)
    prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, args.prompt))
    sampling = SamplingOptions(args.temperature, args.top_k, args.top_p, seed=args.seed).validate()
    request = GenerationRequest(tuple(prompt), args.max_new_tokens, args.drafter or options.drafter, sampling,
                                max_draft_tokens=options.max_draft_tokens, adaptive_draft=options.adaptive_draft)
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
