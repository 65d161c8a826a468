"""`specvox bench faults`: faults injected into live turns, and what the client got anyway.

Runs `specvox up --workers llm=2,tts=2` on a Valkey of its own (with its AOF, so it can be
restarted) and speaks one question per fault through the gateway with the reference client
(real speech, real models; preemptive generation off, so each question makes one turn). While
the turn is under way, at a random point (after a random
number of token-log steps, or of audio chunks in the speech stream), one fault:

- ``llm_kill``: the llm worker holding the turn is SIGKILLed (the supervisor restarts it; the
  benchmark waits for it before the next fault, so two workers are always there at a fault);
- ``tts_kill``: the tts worker holding the turn is SIGKILLed, likewise;
- ``redis_restart``: the Valkey is stopped (SIGTERM: it flushes its AOF) and started again on
  its port and data directory;
- ``none``: no fault, the same kind of turns: the baseline of every figure (the audio gap of a
  busy machine without any fault, above all).

Per fault: whether the turn completed (eos or length); tokens lost and duplicated in the turn's
token log against the uninterrupted reply (the same question in a fresh session through the
standalone Reply call, same plan and sampling; half the turns greedy, half seeded sampling);
whether the reply is identical (the log's tokens, and the text the client got); audio chunks
lost and duplicated at the client (by chunk index); the recovery time (a kill → the next entry
written to the turn's log by whoever resumed it: token log for llm kills, speech stream for tts
ones; for a Redis restart, the longest the token log stood still across the outage); and the
audio gap at the client: the silence a real-time player of the client's chunks, starting at the
first, would hear in the turn (0 when the audio it had been sent ahead covered the recovery).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import os
import random
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.stack import Stack, running_stack
from services.store.embedded import EmbeddedRedis

KINDS = ("none", "llm_kill", "tts_kill", "redis_restart")  # none: the same turns without a fault (the baseline)
QUESTIONS = (
    "Tell me a long story about a brave little dragon.",
    "Can you describe how a volcano erupts step by step?",
    "Tell me a story about a lost cat finding its way home.",
    "What are some good ways to learn a new language?",
    "Can you explain how rain forms in the clouds?",
)
MAX_REPLY_TOKENS = 64
BUDGET_MS = 60_000  # no turn here misses it: nothing is degraded, the plan is the plain one
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
GOALS = {"tokens_lost": 0, "tokens_duplicated": 0, "identical_pct": 100.0, "recovery_p95_ms": 1000.0}
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60


@dataclass
class Fault:
    kind: str
    index: int
    question: str
    sampled: bool
    at: int  # the turn's progress the fault waited for: log steps (llm, redis) or audio chunks (tts)
    turn_id: str = ""
    injected: bool = False  # the turn was still under way at the chosen point
    victim: str = ""
    finish_reason: str = ""
    completed: bool = False
    tokens: int = 0
    reference_tokens: int = 0
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    identical: bool = False
    client_text_identical: bool = False
    chunks: int = 0
    chunks_lost: int = 0
    chunks_duplicated: int = 0
    recovery_ms: float | None = None
    audio_gap_ms: float = 0.0
    error: str = ""
    notes: list[str] = field(default_factory=list)


def run(settings, faults: int, json_path: str | None, seed: int | None = None, kinds: tuple[str, ...] = KINDS) -> int:
    seed = random.randrange(2**31) if seed is None else seed
    print(f"bench faults: {faults} of each of {', '.join(kinds)} (seed {seed})", flush=True)
    rows = asyncio.run(_run(settings, faults, random.Random(seed), kinds))
    result = summarize(rows, faults, seed, settings)
    print_table(result)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


@dataclass
class FaultStack:
    """`specvox up --workers llm=2,tts=2` on free ports and a restartable Valkey of its own."""

    stack: Stack
    valkey: EmbeddedRedis

    @property
    def log(self) -> Path:
        return self.stack.log

    @property
    def addresses(self) -> dict[str, str]:
        return self.stack.addresses

    def workers(self) -> dict[str, tuple[int, str]]:
        """Each worker's latest pid and address, as `specvox up` announced them."""
        found = {}
        for name, pid, address in re.findall(r"(?:re)?started (\S+) \(pid (\d+)\) for (\S+)", self.log.read_text()):
            found[name] = (int(pid), address)
        return found

    async def wait_ready_again(self, name: str, readies_before: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.log.read_text().count(f"{name} ready again") <= readies_before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not restarted within {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


@contextlib.contextmanager
def fault_stack() -> Iterator[FaultStack]:
    work = Path(tempfile.mkdtemp(prefix="specvox-bench-faults-"))
    valkey = EmbeddedRedis(data_dir=work / "valkey")
    env = {"SPECVOX_REDIS__DATA_DIR": str(work / "up"), "SPECVOX_LOG_LEVEL": "WARNING",
           # 60 kills in a run: a worker restarted 20 times is not a crash loop here
           "SPECVOX_SUPERVISOR__MAX_RESTARTS": "1000", "SPECVOX_SUPERVISOR__RESTART_BACKOFF_S": "0.5",
           # one turn per question: a preemptive turn the final drops would be a second one
           "SPECVOX_PREEMPTIVE_GENERATION": "false"}
    try:
        with running_stack(work, args=("--workers", "llm=2,tts=2"), env=env, redis=valkey,
                           start_timeout_s=START_TIMEOUT_S, stop_timeout_s=STOP_TIMEOUT_S) as stack:
            yield FaultStack(stack, valkey)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _run(settings, faults: int, rng: random.Random, kinds: tuple[str, ...]) -> list[Fault]:
    from pipeline.tts.piper_backend import PiperSynthesizer, TtsOptions
    from services.store.client import connect

    voice = PiperSynthesizer(TtsOptions(noise_scale=0.0, noise_w_scale=0.0))
    audio = {q: _speech(voice, q) for q in QUESTIONS}
    rows: list[Fault] = []
    with fault_stack() as stack:
        redis = connect(stack.valkey.url)
        references: dict[tuple[str, bool, int], list[int]] = {}
        try:
            for kind in kinds:
                for i in range(faults):
                    question = QUESTIONS[rng.randrange(len(QUESTIONS))]
                    at = rng.randint(1, 6) if kind != "tts_kill" else rng.randint(1, 12)
                    fault = Fault(kind, i, question, sampled=i % 2 == 1, at=at)
                    try:
                        await _one(stack, redis, fault, audio[question], references)
                    except Exception as e:  # noqa: BLE001 - a fault the stack did not survive is a row too
                        fault.error = f"{type(e).__name__}: {e}"
                    rows.append(fault)
                    print(f"  {kind} {i + 1}/{faults}: {_line(fault)}", flush=True)
        finally:
            await redis.aclose()
    return rows


def _speech(voice, text: str) -> bytes:
    import numpy as np

    from pipeline.audio import float_to_pcm16

    pad = np.zeros(int(0.4 * 16_000), np.float32)
    return float_to_pcm16(np.concatenate([pad, voice.synthesize(text, 16_000), pad]))


async def _one(stack: FaultStack, redis, fault: Fault, pcm: bytes, references: dict) -> None:
    from pipeline.audio import PcmFormat
    from services.client import ClientOptions, Say, converse_script
    from services.protos import load, load_common

    gw, _ = load("gateway")
    common = load_common()
    config = gw.SessionConfig(max_reply_tokens=MAX_REPLY_TOKENS, budget_ms=BUDGET_MS)
    if fault.sampled:
        config.sampling.CopyFrom(common.Sampling(seed=1000 + fault.index, **SAMPLING))
    readies = {name: stack.log.read_text().count(f"{name} ready again") for name in stack.workers()}
    injector = asyncio.create_task(_inject(stack, redis, fault))
    options = ClientOptions(chunk_ms=40, wait_for_replies=True, trailing_silence_s=0.5, config=config)
    try:
        turns = await asyncio.wait_for(converse_script(stack.addresses["gateway"], [Say(pcm)],
                                                       PcmFormat(16_000, 1, 2), options), 300)
    finally:
        if not injector.done():
            injector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await injector
    answered = [t for t in turns if t.report and t.report["finish_reason"] != "cancelled"]
    turn = next((t for t in answered if t.turn_id == fault.turn_id), None) or (answered[-1] if answered else None)
    if len(turns) > len(answered):
        fault.notes.append(f"{len(turns) - len(answered)} turn(s) dropped by the gateway before (a pause in the "
                           "question)")
    if turn is None:
        fault.error = fault.error or "no turn came back"
        return
    fault.turn_id = fault.turn_id or turn.turn_id
    fault.finish_reason = turn.report["finish_reason"]
    fault.completed = fault.finish_reason in ("eos", "length")
    await _judge(stack, redis, fault, turn, config, references)
    if fault.victim:  # two workers at the next fault
        await stack.wait_ready_again(fault.victim, readies.get(fault.victim, 0))


async def _inject(stack: FaultStack, redis, fault: Fault) -> None:
    """Wait for the turn to reach the fault's point, then inject it; record when and what."""
    from services.store.keys import cancel_key, speech_stream_key, token_stream_key, work_key
    from services.store.turn_log import read_speech_log, read_token_log

    stage = "tts" if fault.kind == "tts_kill" else "llm"
    if fault.kind == "none":
        fault.injected = True
        return
    dropped: set[str] = set()  # turns the gateway cancelled (an utterance in two): not the one to fault
    consumer, turn = await _holder(redis, stage, dropped)
    while True:
        if await redis.exists(cancel_key(turn)):
            dropped.add(turn)
            consumer, turn = await _holder(redis, stage, dropped)
            continue
        if fault.kind == "tts_kill":
            entries = await read_speech_log(redis, turn)
            if any(e.kind == "end" for e in entries):
                return  # over before the point: not injected
            if sum(e.kind == "audio" for e in entries) >= fault.at:
                break
        else:
            entries = await read_token_log(redis, turn)
            if entries and entries[-1].end:
                return
            if len(entries) >= fault.at:
                break
        await asyncio.sleep(0.005)
    fault.turn_id = turn
    if fault.kind != "redis_restart":  # the holder may have changed (a reclaim): ask again
        for entry in await redis.xpending_range(work_key(stage), stage, "-", "+", 20):
            [(_, fields)] = await redis.xrange(work_key(stage), entry["message_id"], entry["message_id"]) or [(0, {})]
            if fields.get("turn") == turn:
                consumer = entry["consumer"]
        pid, _ = stack.workers()[consumer]
        fault.victim = consumer
        os.kill(pid, signal.SIGKILL)
        fault.notes.append(f"killed {consumer} (pid {pid})")
        since = time.time()
    else:
        since = time.time()
        await asyncio.to_thread(stack.valkey.restart)
        up = time.time()
        fault.notes.append(f"valkey restarted in {1000 * (up - since):.0f} ms")
        fault.injected = True
        fault.recovery_ms = await _stall_ms(redis, token_stream_key(turn), since, up)
        return
    fault.injected = True
    key = speech_stream_key(turn) if fault.kind == "tts_kill" else token_stream_key(turn)
    fault.recovery_ms = await _first_entry_after(redis, key, since)


async def _holder(redis, stage: str, skip: set[str]) -> tuple[str, str]:
    from services.store.keys import work_key

    while True:
        with contextlib.suppress(Exception):  # the stream may not exist yet
            for entry in await redis.xpending_range(work_key(stage), stage, "-", "+", 10):
                found = await redis.xrange(work_key(stage), entry["message_id"], entry["message_id"])
                if found and found[0][1]["turn"] not in skip:
                    return entry["consumer"], found[0][1]["turn"]
        await asyncio.sleep(0.005)


async def _first_entry_after(redis, key: str, since_s: float, timeout_s: float = 60) -> float | None:
    """ms from `since_s` to the first entry of `key` written after it (its id's server time)."""
    since_ms = int(since_s * 1000)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # Redis coming back
            entries = await redis.xrange(key, min=f"{since_ms + 1}-0", count=1)
            if entries:
                return float(int(entries[0][0].split("-")[0]) - since_ms)
        await asyncio.sleep(0.005)
    return None


async def _stall_ms(redis, key: str, down_s: float, up_s: float, timeout_s: float = 60) -> float | None:
    """The longest gap between consecutive entries of `key` spanning the outage [down_s, up_s]: how
    long the log stood still for it (writes cannot land while the server is down)."""
    if await _first_entry_after(redis, key, up_s, timeout_s) is None:
        return None
    stamps = [int(i.split("-")[0]) for i, _ in await redis.xrange(key)]
    down, up = down_s * 1000, up_s * 1000
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if a <= up and b >= down]
    return float(max(gaps)) if gaps else None


async def _judge(stack: FaultStack, redis, fault: Fault, turn, config, references: dict) -> None:
    from services.store.keys import token_stream_key
    from services.store.turn_log import read_token_log

    entries = await read_token_log(redis, fault.turn_id)
    raw = await redis.xrange(token_stream_key(fault.turn_id))
    seqs = [int(fields["seq"]) for _, fields in raw if "end" not in fields]
    if len(seqs) != len(set(seqs)):
        fault.notes.append(f"{len(seqs) - len(set(seqs))} steps written twice (readers skip them)")
    tokens = [t for e in entries for t in e.token_ids]
    key = (turn.report["transcript"], fault.sampled, fault.index if fault.sampled else 0)
    if key not in references:
        references[key] = await _reference(stack, redis, turn.report["transcript"], config)
    reference = references[key]
    matched = sum(block.size for block in difflib.SequenceMatcher(None, tokens, reference, autojunk=False)
                  .get_matching_blocks())
    fault.tokens, fault.reference_tokens = len(tokens), len(reference)
    fault.tokens_lost, fault.tokens_duplicated = len(reference) - matched, len(tokens) - matched
    fault.identical = tokens == reference
    fault.client_text_identical = turn.reply_text == "".join(e.text for e in entries)
    indices = [chunk for _, chunk, _ in turn.chunks]
    fault.chunks = len(set(indices))
    fault.chunks_duplicated = len(indices) - len(set(indices))
    fault.chunks_lost = (max(indices) + 1 - len(set(indices))) if indices else 0
    fault.audio_gap_ms = _underrun_ms(turn)


async def _reference(stack: FaultStack, redis, user_text: str, config) -> list[int]:
    """The uninterrupted reply: the same request through a live llm worker's Reply, in a fresh session."""
    import grpc

    from services.protos import load
    from services.store.sessions import SessionStore
    from services.store.turn_log import TurnStore

    llm, llm_grpc = load("llm")
    session = await SessionStore(redis).create("")
    turn = await TurnStore(redis).create(session)
    request = llm.ReplyRequest(session_id=session, turn_id=turn, user_text=user_text,
                               max_new_tokens=config.max_reply_tokens, defer_history=True)
    if config.HasField("sampling"):
        request.sampling.CopyFrom(config.sampling)
    for name, (_, address) in sorted(stack.workers().items()):
        if not name.startswith("llm"):
            continue
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                steps = [s async for s in llm_grpc.LlmStub(channel).Reply(request, timeout=120)]
            return [t for s in steps for t in s.token_ids]
        except grpc.aio.AioRpcError:
            continue  # that one is restarting: the other
    raise RuntimeError("no llm worker answered Reply")


def _underrun_ms(turn) -> float:
    """The silence a real-time player of the turn's chunks hears after its first: each chunk plays
    when it has come and the one before it has played."""
    rate = turn.sample_rate_hz or 1
    arrivals = {chunk: at for _, chunk, at in turn.chunks}
    durations = {}
    for (_, chunk, _), (_, pcm) in zip(turn.chunks, turn.audio, strict=False):
        durations[chunk] = 1000 * len(pcm) / 2 / rate
    gap, played_until = 0.0, None
    for chunk in sorted(arrivals):
        at = arrivals[chunk]
        if played_until is not None and at > played_until:
            gap += at - played_until
        played_until = max(played_until or at, at) + durations.get(chunk, 0.0)
    return gap


def _line(f: Fault) -> str:
    if f.error:
        return f"ERROR {f.error}"
    if not f.injected:
        return f"turn over before step {f.at}: not injected ({f.finish_reason})"
    return (f"{f.finish_reason}, identical {f.identical}, lost {f.tokens_lost}, dup {f.tokens_duplicated}, "
            f"chunks lost {f.chunks_lost} dup {f.chunks_duplicated}, recovery {f.recovery_ms} ms, "
            f"gap {f.audio_gap_ms:.0f} ms")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(rows: list[Fault], faults: int, seed: int, settings) -> dict:
    kinds = {}
    for kind in dict.fromkeys(r.kind for r in rows):
        done = [r for r in rows if r.kind == kind and r.injected and not r.error]
        recoveries = [r.recovery_ms for r in done if r.recovery_ms is not None]
        gaps = [r.audio_gap_ms for r in done]
        if kind == "none":
            recoveries = []
        kinds[kind] = {
            "faults": len(done),
            "not_injected": sum(1 for r in rows if r.kind == kind and not r.injected and not r.error),
            "errors": sum(1 for r in rows if r.kind == kind and r.error),
            "turns_completed": sum(r.completed for r in done),
            "tokens_lost": sum(r.tokens_lost for r in done),
            "tokens_duplicated": sum(r.tokens_duplicated for r in done),
            "identical": sum(r.identical and r.client_text_identical for r in done),
            "identical_pct": round(100 * sum(r.identical and r.client_text_identical for r in done) / len(done), 1)
            if done else None,
            "chunks_lost": sum(r.chunks_lost for r in done),
            "chunks_duplicated": sum(r.chunks_duplicated for r in done),
            "recovery_ms": {"p50": _pct(recoveries, 0.5), "p95": _pct(recoveries, 0.95), "max": max(recoveries)
                            if recoveries else None},
            "audio_gap_ms": {"p50": _pct(gaps, 0.5), "p95": _pct(gaps, 0.95), "max": max(gaps) if gaps else None},
        }
    return {
        "command": f"specvox bench faults --faults {faults}",
        "seed": seed,
        "when_unix_s": int(time.time()),
        "settings": {"work": asdict(settings.work), "max_reply_tokens": MAX_REPLY_TOKENS, "sampling": SAMPLING},
        "goals": GOALS,
        "kinds": kinds,
        "met": {kind: _met(kind, k) for kind, k in kinds.items()},
        "rows": [asdict(r) for r in rows],
    }


def _met(kind: str, k: dict) -> bool:
    p95 = k["recovery_ms"]["p95"]
    recovered = kind == "none" or (p95 is not None and p95 <= GOALS["recovery_p95_ms"])
    return (k["tokens_lost"] == 0 and k["tokens_duplicated"] == 0 and k["identical_pct"] == 100.0
            and k["chunks_lost"] == 0 and k["chunks_duplicated"] == 0 and k["turns_completed"] == k["faults"]
            and recovered)


def print_table(result: dict) -> None:
    head = (f"{'fault':<14}{'n':>4}{'done':>6}{'lost':>6}{'dup':>5}{'ident':>7}{'ch lost':>8}{'ch dup':>7}"
            f"{'recov p50':>10}{'p95':>7}{'gap p50':>9}{'p95':>7}  goals")
    print(head)
    for kind, k in result["kinds"].items():
        def ms(v):
            return "-" if v is None else f"{v:.0f}"
        print(f"{kind:<14}{k['faults']:>4}{k['turns_completed']:>6}{k['tokens_lost']:>6}{k['tokens_duplicated']:>5}"
              f"{(k['identical_pct'] or 0):>6.0f}%{k['chunks_lost']:>8}{k['chunks_duplicated']:>7}"
              f"{ms(k['recovery_ms']['p50']):>10}{ms(k['recovery_ms']['p95']):>7}"
              f"{ms(k['audio_gap_ms']['p50']):>9}{ms(k['audio_gap_ms']['p95']):>7}  "
              f"{'met' if result['met'][kind] else 'NOT met'}")
    print(f"(recovery: the fault → the next log entry by whoever resumed the turn; gap: silence a real-time "
          f"player of the client's chunks hears; {sum(1 for r in result['rows'] if r['error'])} errors)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", type=int, default=20, help="faults injected of each kind")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/faults.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.faults, args.json_path)
