"""`specvox bench tts-allocator`: the tts service's memory and speed under glibc's allocator settings.

The same tts service, one process per variant, side by side in one window (so load drifts
alike), each hammered by `CLIENTS` Synthesize calls at a time with the same seeded texts (one to
six sentences of words from the shared prompts, at the voice's own rate and 16, 24 and 48 kHz).
Every `SAMPLE_S` seconds it samples each process's USS (the pages it alone holds). Reported per
variant: calls and seconds of audio made (relative to glibc's own allocator: the speed the
setting costs), USS at the end of the warm-up and at the end, its median over the last third,
its maximum, and the growth fitted after the warm-up (bench/soak.py's rule).

Variants (services/server/allocator.py): `glibc` (the moving mmap threshold), `fixed-4k` (blocks of
256 KiB and up mapped on their own, in 4 KiB pages) and `fixed-huge` (the same in transparent
huge pages), and `fixed-32m` (the threshold where glibc's moving one ends, 32 MiB, from the
start: every buffer from the heap, the level reached in the warm-up rather than at some later
long phrase; the tts's default where jemalloc is not installed). Where the system has jemalloc (Debian: `libjemalloc2`),
`jemalloc`: the same service with jemalloc preloaded in place of glibc's malloc (`malloc_library`),
its freed pages handed back after a second by a background thread, the allocator PyTorch's CPU
performance tuning guide suggests for long-lived model processes (the tts's default where installed).
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.llm.prompt_sets import load_prompts

CLIENTS = 3  # Synthesize calls in flight per variant (the service's model thread takes them in turn)
SAMPLE_S = 15.0
WARMUP_SHARE = 1 / 3
RATES = (0, 16000, 24000, 48000)
GLIBC = {"SPECVOX_MALLOC_LIBRARY": "{}"}  # the glibc variants: not the tts's default, jemalloc where installed
VARIANTS = {
    "glibc": GLIBC | {"SPECVOX_MALLOC_MMAP_THRESHOLD": "{}"},
    "fixed-4k": GLIBC | {"SPECVOX_MALLOC_MMAP_THRESHOLD": '{"tts": 262144}', "SPECVOX_MALLOC_HUGE_PAGES": "false"},
    "fixed-huge": GLIBC | {"SPECVOX_MALLOC_MMAP_THRESHOLD": '{"tts": 262144}', "SPECVOX_MALLOC_HUGE_PAGES": "true"},
    "fixed-32m": GLIBC | {"SPECVOX_MALLOC_MMAP_THRESHOLD": '{"tts": 33554432}', "SPECVOX_MALLOC_HUGE_PAGES": "false"},
}
if ctypes.util.find_library("jemalloc"):  # malloc_library: services/server/allocator.py
    VARIANTS["jemalloc"] = {"SPECVOX_MALLOC_LIBRARY": '{"tts": "jemalloc"}'}


def texts(seed: int):
    """Endless reply-like texts: 1-6 sentences of 2-18 words from the shared prompts' vocabulary."""
    prompts = load_prompts()
    words = [w for text in (*prompts["dialogue"], *prompts["caption"]) for w in re.findall(r"[A-Za-z']+", text)]
    rng = random.Random(seed)
    while True:
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 18))).capitalize()
                     + rng.choice(".,?!;") for _ in range(rng.randint(1, 6))]
        yield " ".join(sentences), rng.choice(RATES)


class Variant:
    def __init__(self, name: str, env: dict[str, str], port: int, log_dir: Path) -> None:
        self.name, self.port = name, port
        self.calls = 0
        self.audio_s = 0.0
        self.errors: list[str] = []
        self.samples: list[tuple[float, float]] = []  # (t_s, USS MB)
        child_env = dict(os.environ, SPECVOX_TTS_PORT=str(port), SPECVOX_WORKER_NAME=f"tts-{name}", **env)
        child_env.pop("GLIBC_TUNABLES", None)
        self.log = open(log_dir / f"tts-{name}.log", "w")  # noqa: SIM115 - open for the process's life
        self.process = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "tts"], env=child_env,
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def uss_mb(self) -> float:
        import psutil

        return psutil.Process(self.process.pid).memory_full_info().uss / 2**20

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _hammer(variant: Variant, seed: int, until: float) -> None:
    import grpc

    from services.gen.specvox.tts.v1 import tts_pb2, tts_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{variant.port}") as channel:
        stub = tts_pb2_grpc.TtsStub(channel)
        for text, rate in texts(seed):
            if time.monotonic() >= until:
                return
            try:
                for event in stub.Synthesize(tts_pb2.SynthesizeRequest(text=text, sample_rate_hz=rate), timeout=300):
                    if event.HasField("audio"):
                        variant.audio_s += len(event.audio.pcm_s16le) / 2 / event.audio.sample_rate_hz
                variant.calls += 1
            except grpc.RpcError as e:
                variant.errors.append(f"{e.code().name}: {e.details()}")


def _ready(port: int, timeout_s: float = 300) -> None:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)


def run(settings, minutes: float, json_path: str | None, log_dir: str = "") -> int:
    import tempfile

    from bench.soak import growth
    from services.stack import free_port

    logs = Path(log_dir or tempfile.mkdtemp(prefix="specvox-tts-allocator-"))
    logs.mkdir(parents=True, exist_ok=True)
    variants = [Variant(name, env, free_port(), logs) for name, env in VARIANTS.items()]
    try:
        print(f"starting {len(variants)} tts services (logs: {logs}) …", flush=True)
        for v in variants:
            _ready(v.port)
        started = time.monotonic()
        until = started + minutes * 60
        threads = [threading.Thread(target=_hammer, args=(v, seed, until), daemon=True)
                   for v in variants for seed in range(CLIENTS)]
        for t in threads:
            t.start()
        while time.monotonic() < until:
            t_s = time.monotonic() - started
            for v in variants:
                v.samples.append((t_s, v.uss_mb()))
            print(f"  {t_s / 60:5.1f} of {minutes:g} min: " + ", ".join(
                f"{v.name} {v.samples[-1][1]:.0f} MB {v.calls} calls" for v in variants), flush=True)
            time.sleep(min(SAMPLE_S, max(0.0, until - time.monotonic())))
        for t in threads:
            t.join(330)
        for v in variants:
            v.samples.append((time.monotonic() - started, v.uss_mb()))
    finally:
        for v in variants:
            v.stop()
    warmup_s = minutes * 60 * WARMUP_SHARE
    base = variants[0].audio_s or 1.0
    rows = []
    for v in variants:
        last = [mb for t, mb in v.samples if t >= minutes * 60 * (1 - WARMUP_SHARE)]
        rows.append({"variant": v.name, "env": VARIANTS[v.name], "calls": v.calls, "audio_s": round(v.audio_s, 1),
                     "audio_vs_glibc": round(v.audio_s / base, 3), "errors": v.errors[:5],
                     "uss_median_last_third_mb": round(statistics.median(last), 1) if last else None,
                     "uss": growth(v.samples, warmup_s),
                     "samples": [(round(t, 1), round(mb, 1)) for t, mb in v.samples]})
    print(f"\n{'variant':<11} {'calls':>6} {'audio s':>8} {'vs glibc':>9} {'USS after warm-up':>18} "
          f"{'end':>6} {'median last third':>18} {'max':>6} {'MB/h after warm-up':>19}")
    def mb(value: float | None, width: int) -> str:  # "-": too few samples after the warm-up
        return f"{value:>{width}.0f}" if value is not None else f"{'-':>{width}}"

    for r in rows:
        u = r["uss"]
        print(f"{r['variant']:<11} {r['calls']:>6} {r['audio_s']:>8.0f} {r['audio_vs_glibc']:>8.2f}x "
              f"{mb(u.get('after_warmup_mb'), 18)} {mb(u.get('end_mb'), 6)} "
              f"{mb(r['uss_median_last_third_mb'], 18)} {mb(u.get('max_mb'), 6)} {mb(u.get('growth_mb_per_h'), 19)}")
    if json_path:
        Path(json_path).write_text(json.dumps({"minutes": minutes, "clients_per_variant": CLIENTS,
                                               "rows": rows}, indent=1))
        print(f"wrote {json_path}")
    return 0 if all(r["calls"] for r in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0, help="how long each variant is hammered")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/tts_allocator.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.minutes, args.json_path)
