"""The Redis side of a turn, on a real embedded Valkey."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.llm.prompts import Exchange
from services.store.client import connect
from services.store.keys import cancel_key, speech_stream_key, token_stream_key, turn_key
from services.store.sessions import SessionStore, UnknownSessionError
from services.store.turn_log import (
    TokenEntry,
    TokenStreamTimeout,
    TokenStreamWriter,
    TurnLogWriter,
    TurnStore,
    UnknownTurnError,
    finish_turn,
    read_speech_log,
    read_token_stream,
)


@pytest.fixture
async def client(redis_url):
    c = connect(redis_url)
    yield c
    await c.aclose()


async def test_reader_sees_entries_as_the_writer_appends_them(client):
    turn = await TurnStore(client).create("s1")
    writer = TokenStreamWriter(client, turn, ttl_s=60)
    seen: list[TokenEntry] = []

    async def read():
        async for entry in read_token_stream(client, turn, timeout_s=5):
            seen.append(entry)

    reader = asyncio.create_task(read())
    for seq, word in enumerate(["Hello", " there", ","]):
        await writer.append(TokenEntry(seq, (10 + seq, 20 + seq), word, 2, 1000 + seq))
        await asyncio.sleep(0.05)
    await writer.append(TokenEntry(3, (), "", 0, 2000, end=True, finish_reason="eos"))
    await asyncio.wait_for(reader, 5)
    assert [e.text for e in seen] == ["Hello", " there", ",", ""]
    assert seen[1].token_ids == (11, 21) and seen[1].accepted == 2
    assert seen[-1].end and seen[-1].finish_reason == "eos"
    assert 0 < await client.ttl(token_stream_key(turn)) <= 60  # the stream expires


async def test_a_late_reader_replays_the_whole_stream(client):
    writer = TokenStreamWriter(client, "late-turn")
    await writer.append(TokenEntry(0, (5,), "Hi", 1, 1))
    await writer.append(TokenEntry(1, (), "", 0, 2, end=True, finish_reason="length"))
    entries = [e async for e in read_token_stream(client, "late-turn", timeout_s=1)]
    assert [e.seq for e in entries] == [0, 1]


async def test_a_stalled_stream_times_out(client):
    await TokenStreamWriter(client, "stalled").append(TokenEntry(0, (5,), "Hi", 1, 1))
    with pytest.raises(TokenStreamTimeout, match="no token entry"):
        async for _ in read_token_stream(client, "stalled", timeout_s=0.3):
            pass


async def test_sessions_keep_a_bounded_history_and_reject_unknown_ids(client):
    sessions = SessionStore(client)
    session = await sessions.create("be brief")
    assert (await sessions.require(session))["system_prompt"] == "be brief"
    for i in range(25):
        await sessions.append(session, Exchange(f"q{i}", f"a{i}"), keep=20)
    history = await sessions.history(session)
    assert len(history) == 20 and history[-1] == Exchange("q24", "a24")
    with pytest.raises(UnknownSessionError):
        await sessions.require("no-such-session")


async def test_turns_belong_to_their_session(client):
    turns = TurnStore(client)
    turn = await turns.create("session-a")
    await turns.require(turn, "session-a")
    with pytest.raises(UnknownTurnError, match="does not belong"):
        await turns.require(turn, "session-b")
    with pytest.raises(UnknownTurnError, match="unknown turn"):
        await turns.require("nope", "session-a")


async def test_a_session_in_use_does_not_expire_and_keeps_what_was_heard(client):
    sessions = SessionStore(client, ttl_s=2)
    session = await sessions.create("Be brief.", '{"budgetMs": 800}')
    await sessions.append(session, Exchange("Tell me a story.", "Once upon a", cut_off=True))
    for _ in range(3):  # 3 s of turns, each pushing the 2 s expiry ahead
        await asyncio.sleep(1.0)
        await sessions.touch(session)
    assert (await sessions.require(session))["config"] == '{"budgetMs": 800}'
    assert await sessions.history(session) == (Exchange("Tell me a story.", "Once upon a", cut_off=True),)
    await asyncio.sleep(2.2)  # left alone, it goes
    with pytest.raises(UnknownSessionError):
        await sessions.require(session)
    assert await sessions.history(session) == ()


async def test_a_finished_turn_expires_soon_and_late_appends_do_not_keep_it_an_hour(client):
    """What a stack keeps in Redis is bounded by its recent turns: once the speech stream ends
    (`finish_turn`, finished_turn_ttl_s) every key of the turn expires soon, and a cancelled reply's
    last steps, written after that, do not push its token log back to token_stream_ttl_s."""
    turn = await TurnStore(client, ttl_s=3600).create("s1")
    tokens = TurnLogWriter(client, turn, "llm", token_stream_key(turn), ttl_s=3600)
    speech = TurnLogWriter(client, turn, "tts", speech_stream_key(turn), ttl_s=3600)
    await tokens.claim()
    await speech.claim()
    await tokens.append({"seq": 0, "text": "Hi"})
    await speech.append({"n": 0, "kind": "phrase"})
    await client.set(cancel_key(turn), "barge-in", ex=3600)
    assert 3000 < await client.ttl(token_stream_key(turn)) <= 3600  # a turn under way lives long
    await finish_turn(client, turn, 30)
    keys = (turn_key(turn), token_stream_key(turn), speech_stream_key(turn), cancel_key(turn))
    assert all([0 < await client.ttl(k) <= 30 for k in keys])
    assert await tokens.append({"seq": 1, "end": 1})  # written after the end: still told it is cancelled
    assert 0 < await client.ttl(token_stream_key(turn)) <= 30
    other = await TurnStore(client, ttl_s=3600).create("s1")  # a turn not finished: the full expiry
    log = TurnLogWriter(client, other, "llm", token_stream_key(other), ttl_s=3600)
    await log.claim()
    await log.append({"seq": 0})
    assert await client.ttl(token_stream_key(other)) > 3000


async def test_a_turn_whose_speech_ends_in_an_error_expires_as_a_finished_one(client):
    """A SpeakTurn the tts refuses or gives up on ends the turn's speech stream with the error,
    and the turn's keys then expire as any finished turn's (finished_turn_ttl_s), not in an hour."""
    from services.stages.tts import _end_speech

    turn = await TurnStore(client, ttl_s=3600).create("s1")
    error = "INVALID_ARGUMENT: unknown voice 'nobody'"
    await _end_speech(client, turn, "error", error, 30)
    [end] = await read_speech_log(client, turn)
    assert end.kind == "end" and end.data == {"finish_reason": "error", "error": error}
    assert all([0 < await client.ttl(k) <= 30 for k in (turn_key(turn), speech_stream_key(turn))])
