"""Turns that survive their workers: `specvox up --workers llm=2,tts=2`, real models, real Valkey.

A worker holding a turn is SIGKILLed in the middle of it (once the turn's log shows it under
way); the other worker of the stage reclaims the turn after `work.claim_idle_ms` and resumes it
from the turn's logs in Redis. What the client gets must be what it would have got without the
kill: the same reply token for token (greedy), and every audio chunk, word and phrase once.
Also: a poison work entry is dead-lettered, and a worker drained by SIGTERM hands its turn back.
One kill of each kind; the counts over many faults are `specvox bench faults`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest

from pipeline.audio import PcmFormat, float_to_pcm16
from pipeline.tts.phrases import PhraseCutter, PhraseOptions
from services.client import ClientOptions, Say, converse_script
from services.protos import load
from services.settings import Settings
from services.store.client import connect
from services.store.keys import dead_key, speech_stream_key, token_stream_key, turn_key, work_key
from services.store.turn_log import read_speech_log, read_token_log
from tests.conftest import specvox_up

pytestmark = pytest.mark.e2e
gw, gw_grpc = load("gateway")
llm, llm_grpc = load("llm")
FMT = PcmFormat(16_000, 1, 2)
STORY = "Tell me a long story about a brave little dragon."
# A budget no turn misses here, so nothing is degraded and the reply is the plain greedy one.
CONFIG = {"max_reply_tokens": 72, "budget_ms": 60_000}
# The drained turn's reply is longer: SIGTERM reaches the worker's event loop a poll or more
# after the log's second entry, and on a busy machine 70 tokens can be written in that time.
DRAINED_CONFIG = CONFIG | {"max_reply_tokens": 256}
# Drained by SIGTERM, a worker hands its turn back at once (a grace of 0): with any grace the rest
# of a short reply may finish inside it on a fast step, and the hand-back would go untested.
ENV = {"SPECVOX_WORK__DRAIN_GRACE_S": "0", "SPECVOX_SUPERVISOR__RESTART_BACKOFF_S": "0.5"}


@pytest.fixture(scope="module")
def workers(redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("failover")
    with specvox_up(redis_url, log_dir, env=ENV, args=("--workers", "llm=2,tts=2")) as addresses:
        yield addresses | {"log": log_dir / "up.log"}


def worker_pids(log: Path) -> dict[str, tuple[int, str]]:
    """Each worker's latest pid and address, as `specvox up` announced them."""
    found = {}
    for name, pid, address in re.findall(r"(?:re)?started (\S+) \(pid (\d+)\) for (\S+)", log.read_text()):
        found[name] = (int(pid), address)
    return found


async def holder(redis, stage: str) -> tuple[str, str]:
    """(consumer, turn id) of the stage's work entry being worked on, waiting until there is one."""
    while True:
        for entry in await redis.xpending_range(work_key(stage), stage, "-", "+", 10):
            [(_, fields)] = await redis.xrange(work_key(stage), entry["message_id"], entry["message_id"])
            return entry["consumer"], fields["turn"]
        await asyncio.sleep(0.02)


async def signal_mid_turn(redis, stage: str, log: Path, under_way, sig: signal.Signals = signal.SIGKILL) -> dict:
    """Send `sig` to the worker holding the stage's next turn once `under_way(turn)` says it is half done.

    The holder is frozen (SIGSTOP) while `under_way` reads the turn's logs and until the signal is
    sent: on a busy machine this test's own polls can lag the worker by seconds, and a turn seen
    half done could otherwise be over by the time the signal lands (CI once drained a reply at its
    end). Frozen, it writes nothing between the look and the signal."""
    consumer, turn = await holder(redis, stage)
    pid, _ = worker_pids(log)[consumer]
    while True:
        os.kill(pid, signal.SIGSTOP)
        try:
            if await under_way(turn):
                os.kill(pid, sig)
                return {"consumer": consumer, "turn": turn, "pid": pid, "unix_ms": int(time.time() * 1000)}
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed and reaped already
                os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(0.01)


async def talk(addresses, speech, text: str, config: dict = CONFIG) -> list:
    options = ClientOptions(chunk_ms=40, wait_for_replies=True, trailing_silence_s=0.5,
                            config=gw.SessionConfig(**config))
    return await asyncio.wait_for(converse_script(addresses["gateway"], [Say(float_to_pcm16(speech(text)))], FMT,
                                                  options), 240)


async def uninterrupted_reply(address: str, redis, user_text: str, max_new_tokens: int = CONFIG["max_reply_tokens"]
                              ) -> list[int]:
    """The same turn decoded by the standalone Reply call of a live worker, in a new session."""
    from services.store.sessions import SessionStore
    from services.store.turn_log import TurnStore

    session = await SessionStore(redis).create("")
    turn = await TurnStore(redis).create(session)
    async with grpc.aio.insecure_channel(address) as channel:
        steps = [s async for s in llm_grpc.LlmStub(channel).Reply(llm.ReplyRequest(
            session_id=session, turn_id=turn, user_text=user_text, max_new_tokens=max_new_tokens,
            defer_history=True))]
    assert steps[-1].end and steps[-1].finish_reason in ("eos", "length")
    return [t for s in steps for t in s.token_ids]


def live_worker(log: Path, stage: str, not_this: str) -> str:
    return next(address for name, (_, address) in worker_pids(log).items()
                if name.startswith(stage) and name != not_this)


async def test_an_llm_worker_killed_mid_reply_the_other_finishes_it_token_for_token(workers, speech):
    redis = connect(workers["redis"])
    try:
        async def three_steps_in(turn: str) -> bool:
            entries = await read_token_log(redis, turn)
            assert not (entries and entries[-1].end), "the reply ended before the kill: make it longer"
            return len(entries) >= 3

        killer = asyncio.create_task(signal_mid_turn(redis, "llm", workers["log"], three_steps_in))
        turns = await talk(workers, speech, STORY)
        killed = await killer
        turn = next(t for t in turns if t.turn_id == killed["turn"])
        assert turn.report["finish_reason"] in ("eos", "length"), turn.report
        entries = await read_token_log(redis, killed["turn"])
        assert [e.seq for e in entries] == list(range(len(entries))) and entries[-1].end  # each step once
        assert int(await redis.hget(turn_key(killed["turn"]), "llm_epoch")) >= 2  # a second worker took it
        tokens = [t for e in entries for t in e.token_ids]
        address = live_worker(workers["log"], "llm", killed["consumer"])
        assert tokens == await uninterrupted_reply(address, redis, turn.report["transcript"])
        assert turn.reply_text == "".join(e.text for e in entries)  # the client got every delta once
    finally:
        await redis.aclose()


async def test_a_tts_worker_killed_mid_reply_the_client_hears_each_phrase_once(workers, speech):
    redis = connect(workers["redis"])
    try:
        async def first_audio_out(turn: str) -> bool:
            entries = await read_speech_log(redis, turn)
            assert not any(e.kind == "end" for e in entries), "the speech ended before the kill"
            return any(e.kind == "audio" for e in entries)

        killer = asyncio.create_task(signal_mid_turn(redis, "tts", workers["log"], first_audio_out))
        turns = await talk(workers, speech, STORY)
        killed = await killer
        turn = next(t for t in turns if t.turn_id == killed["turn"])
        assert turn.report["finish_reason"] in ("eos", "length"), turn.report
        assert int(await redis.hget(turn_key(killed["turn"]), "tts_epoch")) >= 2
        chunks = [(phrase, chunk) for phrase, chunk, _ in turn.chunks]
        assert [c for _, c in chunks] == list(range(len(chunks)))  # every chunk once, none missing, in order
        phrases = [p for p, _ in chunks]
        assert phrases == sorted(phrases) and set(phrases) == set(range(max(phrases) + 1))
        assert len(turn.cues) == max(phrases) + 1  # one cue per phrase
        # The phrases as a tts worker cuts them from the token log, entry by entry: each said once, in order.
        cutter = PhraseCutter(PhraseOptions())
        entries = await read_token_log(redis, killed["turn"])
        expected = [p for e in entries for p in cutter.feed(e.text)] + cutter.flush()
        assert [words(c.text) for c in turn.cues] == [words(p) for p in expected]
        said = [w.text for w in turn.word_cues]
        assert words(" ".join(said)) == words(turn.reply_text)  # every written word once, in order
        starts = [start for start, _ in turn.audio]
        assert starts == sorted(starts)  # one timeline, no audio laid twice
        # What is done is not kept: the work entries are gone, the speech stream (audio) soon expires.
        assert 0 < await redis.ttl(speech_stream_key(killed["turn"])) <= Settings().finished_turn_ttl_s
        assert not [e for e in await redis.xpending_range(work_key("tts"), "tts", "-", "+", 50)]
    finally:
        await redis.aclose()


async def test_a_poison_work_entry_is_dead_lettered_and_the_workers_go_on(workers, speech):
    redis = connect(workers["redis"])
    try:
        before = await redis.xlen(dead_key("llm"))
        poison = await redis.xadd(work_key("llm"), {"turn": "poison", "request": "{this is not a request"})
        deadline = time.monotonic() + 60
        while await redis.xlen(dead_key("llm")) == before:
            assert time.monotonic() < deadline, "the poison entry was not dead-lettered"
            await asyncio.sleep(0.1)
        [(_, letter)] = await redis.xrevrange(dead_key("llm"), count=1)
        assert letter["work_id"] == poison and letter["deliveries"] == "3"
        assert "ParseError" in letter["error"], letter
        assert not [e for e in await redis.xpending_range(work_key("llm"), "llm", "-", "+", 10)
                    if e["message_id"] == poison]
        token_log = [e async for e in _entries(redis, token_stream_key("poison"))]
        assert token_log and token_log[-1]["finish_reason"] == "error"  # a reader of the turn learns it failed
        turns = await talk(workers, speech, "What is the capital of France?")
        assert any(t.report and t.report["finish_reason"] in ("eos", "length") for t in turns)
    finally:
        await redis.aclose()


async def test_a_worker_drained_by_sigterm_hands_its_turn_back_and_the_reply_completes(workers, speech):
    redis = connect(workers["redis"])
    try:
        async def two_steps_in(turn: str) -> bool:
            entries = await read_token_log(redis, turn)
            assert not (entries and entries[-1].end), "the reply ended before the drain: make it longer"
            return len(entries) >= 2

        drainer = asyncio.create_task(signal_mid_turn(redis, "llm", workers["log"], two_steps_in, signal.SIGTERM))
        turns = await talk(workers, speech, STORY, DRAINED_CONFIG)
        drained = await drainer
        turn = next(t for t in turns if t.turn_id == drained["turn"])
        assert turn.report["finish_reason"] in ("eos", "length"), turn.report
        entries = await read_token_log(redis, drained["turn"])
        assert [e.seq for e in entries] == list(range(len(entries)))
        epoch = int(await redis.hget(turn_key(drained["turn"]), "llm_epoch"))
        assert epoch >= 2, f"no hand-back: the reply ({len(entries)} entries) ended before the drain took it"
        tokens = [t for e in entries for t in e.token_ids]
        address = live_worker(workers["log"], "llm", drained["consumer"])
        assert tokens == await uninterrupted_reply(address, redis, turn.report["transcript"],
                                                   DRAINED_CONFIG["max_reply_tokens"])
        speech_entries = await read_speech_log(redis, drained["turn"])
        assert speech_entries and speech_entries[-1].kind == "end"
    finally:
        await redis.aclose()


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


async def _entries(redis, key: str):
    for _, fields in await redis.xrange(key):
        yield fields
