"""`specvox bench soak`: conversations without end through `specvox up`, memory sampled as they run.

`--sessions` clients (bench e2e's: real speech in real time, the bundled Piper voice and
espeak-ng voices, questions, follow-ups, backchannels, barge-ins and paused sentences, a fresh
gateway session every five turns) talk to the stack for `--minutes`. Every `--sample-s` seconds
it samples the memory of each service's process and of the Valkey (USS, the pages the process
alone holds, which is what a leak grows, and RSS, which also counts the mapped model files the
kernel drops and reads back under memory pressure), Redis's own `INFO memory` used_memory, and
its keys by kind. After a warm-up (the first third of the run, at most WARMUP_MAX_S: models touch
their pages, caches fill) a straight line fitted to each series gives its growth per hour; "flat"
is growth within FLAT_MB_PER_H or FLAT_SHARE_PER_H of its level, whichever is larger, judged on
USS and used_memory. Writes the samples and the fits as JSON and the curves as a PNG.

A process restarted during the run (a supervisor) shows as a new pid in the samples and is
counted; the fit then covers both lives.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WARMUP_MAX_S = 300.0
PROGRESS_EVERY_S = 60.0  # a progress line this often
FLAT_MB_PER_H = 5.0
FLAT_SHARE_PER_H = 0.02  # 2 % of the series' post-warm-up mean per hour
SCRIPT_TURNS = 10  # each session's script (two cycles of bench e2e's five kinds), said over and over
MB = 1024 * 1024
ID = re.compile(r"[0-9a-f]{16,}")  # session and turn ids in Redis keys, counted together


@dataclass
class Tally:
    """What the conversations did, for the report beside the memory."""

    started_unix_s: float = 0.0
    answered: list[tuple[float, float]] = field(default_factory=list)  # (t_s, voice to voice ms)
    script_turns: int = 0
    failed_segments: list[str] = field(default_factory=list)
    rounds: int = 0

    def add(self, t_s: float, outcomes) -> None:
        """A round's outcomes (bench e2e's), each answered turn at the time the gateway took it up."""
        self.rounds += 1
        self.script_turns += len(outcomes)
        for o in outcomes:
            for r in o.rows:
                took_ms = r["stages"].get("gateway", {}).get("first_in_unix_ms")
                self.answered.append((took_ms / 1000 - self.started_unix_s if took_ms else t_s, r["voice_to_voice_ms"]))
            if o.note.startswith("segment"):
                self.failed_segments.append(o.note)


class Sampler(threading.Thread):
    """Every `every_s`: RSS of each process of the stack, Redis's used_memory and key count."""

    def __init__(self, stack, every_s: float, tally: Tally, started: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        import redis

        self.stack, self.every_s, self.tally, self.started = stack, every_s, tally, started
        self.redis = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def sample(self) -> dict:
        import psutil

        rss, uss, pids = {}, {}, {}
        for name, process in sorted(self.stack.processes().items()):
            try:
                memory = process.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss[name], uss[name], pids[name] = memory.rss / MB, memory.uss / MB, process.pid
        row = {"t_s": round(time.monotonic() - self.started, 1), "uss_mb": uss, "rss_mb": rss, "pids": pids,
               "answered_turns": len(self.tally.answered)}
        try:
            info = self.redis.info("memory")
            kinds = Counter(ID.sub("*", key) for key in self.redis.scan_iter(count=1000))
            row |= {"redis_used_mb": info["used_memory"] / MB, "redis_keys": sum(kinds.values()),
                    "redis_keys_by_kind": dict(kinds.most_common())}
        except Exception as e:  # noqa: BLE001 - a sample without Redis says why, the run goes on
            row["redis_error"] = f"{type(e).__name__}: {e}"
        return row

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(self.sample())
            self.stop.wait(self.every_s)
        self.samples.append(self.sample())
        self.redis.close()


# ---- figures ---------------------------------------------------------------------------------

def series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(t_s, MB) per series: each process's USS ("llm"…, "valkey" for the server's) and RSS ("llm rss"…),
    and "redis used_memory". USS, the pages the process alone holds, is what a leak grows; RSS also
    counts mapped files (the model weights), which the kernel drops and reads back under memory pressure."""
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for key, suffix in (("uss_mb", ""), ("rss_mb", " rss")):
            for name, mb in s.get(key, {}).items():
                out.setdefault(("valkey" if name == "redis" else name) + suffix, []).append((s["t_s"], mb))
        if "redis_used_mb" in s:
            out.setdefault("redis used_memory", []).append((s["t_s"], s["redis_used_mb"]))
    return out


def growth(points: list[tuple[float, float]], warmup_s: float) -> dict:
    """The series after the warm-up, fitted by a straight line: its level and growth per hour."""
    after = [(t, mb) for t, mb in points if t >= warmup_s]
    if len(after) < 3:
        return {"samples": len(after), "growth_mb_per_h": None, "flat": None}
    t_h = np.array([t for t, _ in after]) / 3600
    mb = np.array([m for _, m in after])
    slope, _ = np.polyfit(t_h, mb, 1)
    level = float(mb.mean())
    flat = abs(slope) <= max(FLAT_MB_PER_H, FLAT_SHARE_PER_H * level)
    return {"samples": len(after), "first_mb": round(points[0][1], 1), "after_warmup_mb": round(float(mb[0]), 1),
            "end_mb": round(float(mb[-1]), 1), "max_mb": round(float(mb.max()), 1), "mean_mb": round(level, 1),
            "growth_mb_per_h": round(float(slope), 2), "growth_pct_per_h": round(100 * float(slope) / level, 2),
            "fitted_change_mb": round(float(slope * (t_h[-1] - t_h[0])), 2), "flat": bool(flat)}


def restarts(samples: list[dict]) -> dict[str, int]:
    seen: dict[str, set[int]] = {}
    for s in samples:
        for name, pid in s["pids"].items():
            seen.setdefault(name, set()).add(pid)
    return {name: len(pids) - 1 for name, pids in sorted(seen.items())}


def voice_to_voice(tally: Tally, duration_s: float) -> dict:
    """p50 in the first and the last third of the run: a stack that slows as it ages shows here."""
    def p50(lo: float, hi: float):
        v = [ms for t, ms in tally.answered if lo <= t < hi and ms is not None]
        return round(statistics.median(v)) if v else None

    third = duration_s / 3
    return {"first_third_p50_ms": p50(0, third), "last_third_p50_ms": p50(2 * third, float("inf"))}


def plot(samples: list[dict], fits: dict, warmup_s: float, path: Path, title: str) -> None:
    """Three panels: each process's USS (RSS dotted), its change since the warm-up (the fitted line
    dashed: flat is what the goal asks), and Redis's used_memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (level_ax, change_ax, redis_ax) = plt.subplots(1, 3, figsize=(15, 4))
    colours: dict[str, str] = {}
    changes: list[float] = [-5.0, 5.0]  # the change panel's range: the post-warm-up changes (±5 MB at least)
    for name, points in series(samples).items():
        t = np.array([p[0] for p in points]) / 60
        mb = np.array([p[1] for p in points])
        process, rss = name.removesuffix(" rss"), name.endswith(" rss")
        fit = fits.get(name, {})
        rate = f" ({fit['growth_mb_per_h']:+.1f} MB/h)" if fit.get("growth_mb_per_h") is not None else ""
        if name == "redis used_memory":
            (line,) = redis_ax.plot(t, mb, label="used_memory" + rate, linewidth=1.2)
            axes = [(redis_ax, mb)]
        else:
            (line,) = level_ax.plot(t, mb, label=None if rss else name, linewidth=0.6 if rss else 1.2,
                                    linestyle=":" if rss else "-", color=colours.get(process))
            colours.setdefault(process, line.get_color())
            axes = []
            after = t >= warmup_s / 60
            if not rss and after.any():
                base = mb[after][0]
                change_ax.plot(t, mb - base, label=name + rate, linewidth=1.2, color=line.get_color())
                changes += [float((mb - base)[after].min()), float((mb - base)[after].max())]
                axes = [(change_ax, mb - base)]
        after = t >= warmup_s / 60
        for ax, values in axes:
            if fit.get("growth_mb_per_h") is not None and after.sum() >= 3:
                k, b = np.polyfit(t[after], values[after], 1)
                ax.plot(t[after], k * t[after] + b, linestyle="--", linewidth=0.8, color=line.get_color())
    level_ax.plot([], [], linestyle=":", color="grey", label="RSS (dotted)")
    span = max(changes) - min(changes)
    change_ax.set_ylim(min(changes) - 0.15 * span, max(changes) + 0.15 * span)
    level_ax.set_yscale("log")
    for ax, ylabel in ((level_ax, "private memory, USS (MB)"), (change_ax, "USS change since the warm-up (MB)"),
                       (redis_ax, "Redis used_memory (MB)")):
        ax.axvspan(0, warmup_s / 60, color="#eeeeee", label="warm-up")
        ax.set(xlabel="minutes", ylabel=ylabel)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def judged(fits: dict) -> dict:
    """The series the goal is judged on: USS and Redis's used_memory (RSS is shown, not judged)."""
    return {name: f for name, f in fits.items() if not name.endswith(" rss")}


def print_table(fits: dict, restarted: dict, turns: dict) -> None:
    print(f"\n  {'MB':<20} {'start':>8} {'warm':>8} {'end':>8} {'max':>8} {'MB/h':>8} {'%/h':>7}  flat")
    for name, f in sorted(fits.items(), key=lambda kv: (kv[0].endswith(" rss"), kv[0])):
        if f.get("growth_mb_per_h") is None:
            print(f"  {name:<20} (too few samples after the warm-up)")
            continue
        print(f"  {name:<20} {f['first_mb']:>8.1f} {f['after_warmup_mb']:>8.1f} {f['end_mb']:>8.1f} "
              f"{f['max_mb']:>8.1f} {f['growth_mb_per_h']:>+8.1f} {f['growth_pct_per_h']:>+7.2f}  "
              f"{'(not judged)' if name.endswith(' rss') else 'yes' if f['flat'] else 'NO'}")
    print(f"  restarts: {', '.join(f'{k} {v}' for k, v in restarted.items())}")
    print(f"  {turns['answered_turns']} answered turns over {turns['script_turns']} script turns; "
          f"failed segments {turns['failed_segments']}; voice to voice p50 "
          f"{turns['voice_to_voice']['first_third_p50_ms']} ms (first third) → "
          f"{turns['voice_to_voice']['last_third_p50_ms']} ms (last third)")


# ---- the run ---------------------------------------------------------------------------------

async def _converse(address: str, scripts: list, stop_at: float, tally: Tally, started: float) -> None:
    from bench.e2e import run_session

    async def one(i: int, lines) -> None:
        while time.monotonic() < stop_at:
            tally.add(time.monotonic() - started, await run_session(address, i, len(scripts), lines))

    async def progress() -> None:
        """A line a minute: how far the run is, what it has answered, how long is left."""
        total = stop_at - started
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            elapsed = time.monotonic() - started
            print(f"  {elapsed / 60:5.1f} of {total / 60:g} min: {len(tally.answered)} answered turns, "
                  f"{len(tally.failed_segments)} failed segments, {max(0.0, total - elapsed) / 60:.1f} min left",
                  flush=True)

    tasks = [asyncio.create_task(one(i, lines)) for i, lines in enumerate(scripts)]
    reporter = asyncio.create_task(progress())
    try:
        await asyncio.wait(tasks, timeout=max(0.0, stop_at - time.monotonic()))
    finally:
        reporter.cancel()
        for task in tasks:  # mid-conversation: the client goes away, as a real one may
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, Exception):  # a session that broke down before the end: said, not lost
                tally.failed_segments.append(f"session ended early: {type(result).__name__}: {result}")


def run(settings, minutes: float, sessions: int, json_path: str | None, out_dir: str, sample_s: float = 5.0) -> int:
    from bench.e2e import Voices, session_script
    from services.stack import running_stack
    from services.store.embedded import EmbeddedRedis

    duration_s = minutes * 60
    warmup_s = min(WARMUP_MAX_S, duration_s / 3)
    voices = Voices(settings)
    print(f"making speech for {sessions} sessions × {SCRIPT_TURNS} turns ({', '.join(voices.names())}) …", flush=True)
    rng = random.Random(12)
    scripts = [session_script(voices, i, SCRIPT_TURNS, rng) for i in range(sessions)]
    tally = Tally()
    work = Path(tempfile.mkdtemp(prefix="specvox-soak-"))
    redis = settings.redis_url or EmbeddedRedis()  # unless configured, a Valkey whose URL it knows: it reads Redis
    up_data = {"SPECVOX_REDIS__DATA_DIR": str(work / "up")}  # not the user's: its cluster credential, if any
    with running_stack(work, redis=redis, host=settings.host, env=up_data) as stack:
        print(f"{sessions} sessions for {minutes:g} min, memory every {sample_s:g} s "
              f"(warm-up {warmup_s / 60:.1f} min) …", flush=True)
        started, tally.started_unix_s = time.monotonic(), time.time()
        sampler = Sampler(stack, sample_s, tally, started)
        sampler.start()
        try:
            asyncio.run(_converse(stack.addresses["gateway"], scripts, started + duration_s, tally, started))
        finally:
            sampler.stop.set()
            sampler.join(30)
        wall_s = time.monotonic() - started
    samples = sampler.samples
    fits = {name: growth(points, warmup_s) for name, points in series(samples).items()}
    restarted = restarts(samples)
    turns = {"rounds": tally.rounds, "script_turns": tally.script_turns, "answered_turns": len(tally.answered),
             "failed_segments": len(tally.failed_segments), "failures": tally.failed_segments[:10],
             "voice_to_voice": voice_to_voice(tally, wall_s)}
    print_table(fits, restarted, turns)
    results = {"minutes": minutes, "wall_s": round(wall_s, 1), "sessions": sessions, "sample_s": sample_s,
               "warmup_s": warmup_s, "flat_rule": {"mb_per_h": FLAT_MB_PER_H, "share_per_h": FLAT_SHARE_PER_H},
               "growth": fits, "flat": {name: f["flat"] for name, f in judged(fits).items()},
               "restarts": restarted, "turns": turns, "samples": samples}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {json_path}")
    # after the JSON: an hour's samples are not lost to a plotting library missing
    png = Path(out_dir) / "soak_memory.png"
    try:
        plot(samples, fits, warmup_s, png, f"specvox bench soak: {sessions} sessions, {wall_s / 60:.1f} min, "
                                           f"{len(tally.answered)} answered turns")
        print(f"wrote {png}")
    except ImportError as e:
        print(f"no plot ({e}): pip install -e '.[bench]' for matplotlib")
    flat = all(f["flat"] is not False for f in judged(fits).values())
    return 0 if tally.answered and flat and not any(restarted.values()) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the conversations run")
    parser.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/soak.json",
                        help="write the rows here (default: %(default)s, the current figures)")
    parser.add_argument("--out", default="docs/benchmarks/results", help="folder for the memory PNG")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.minutes, args.sessions, args.json_path, args.out, args.sample_s)
