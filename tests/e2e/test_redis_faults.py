"""Redis faults for real: a Valkey of these tests' own, restarted and stopped under live clients
and under `specvox up`'s four services (the other tests' Valkey is never touched).

What is promised (docs/reliability.md, "Redis faults"): what was written survives a restart;
a call that cannot reach Redis within `redis.retry_deadline_s` fails with UNAVAILABLE naming
Redis, and the same services serve again once it is back; a restart inside a turn is ridden
out (the turn completes), Redis down past the deadline fails the turn with UNAVAILABLE and
the session survives.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from pipeline.asr_stream import normalised_text
from pipeline.llm.prompts import Exchange
from services.protos import load, load_common
from services.store.client import RedisOptions, RedisUnavailableError, connect
from services.store.embedded import EmbeddedRedis
from services.store.keys import session_key
from services.store.sessions import SessionStore
from services.store.turn_log import TokenEntry, TokenStreamWriter, TurnStore, read_token_stream
from tests.conftest import specvox_up
from tests.grpc_status import expect_status

gw, gw_grpc = load("gateway")
llm, llm_grpc = load("llm")
tts, tts_grpc = load("tts")
common = load_common()
DEADLINE_S = 3.0  # the stack's redis.retry_deadline_s: a restart fits in it, a test's outage does not
STORY = "Tell me a long story about a lighthouse keeper and a storm."


# -- clients alone --------------------------------------------------------------------------

@pytest.fixture
def valkey(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path / "valkey") as server:
        yield server


async def test_a_blocked_read_rides_out_a_restart_and_waits_past_the_socket_timeout(valkey):
    client = connect(valkey.url, RedisOptions(socket_timeout_s=1.0, retry_deadline_s=DEADLINE_S))
    writer = TokenStreamWriter(client, "t1")
    try:
        reader = asyncio.create_task(_texts(read_token_stream(client, "t1", timeout_s=10)))
        await writer.append(TokenEntry(0, (1,), "Hello", 1, 1))
        await asyncio.sleep(0.3)  # the reader is blocked in XREAD on a connection the restart cuts
        await asyncio.to_thread(valkey.restart)
        await writer.append(TokenEntry(1, (2,), " there", 1, 2))
        await writer.append(TokenEntry(1, (2,), " there", 1, 2))  # an XADD retried after its reply was lost
        await asyncio.sleep(2.5)  # longer than the socket timeout: an idle wait is not a dead connection
        await writer.append(TokenEntry(2, (), "", 0, 3, end=True, finish_reason="eos"))
        assert await asyncio.wait_for(reader, 20) == ["Hello", " there", ""]
    finally:
        await client.aclose()


async def test_what_was_written_survives_a_restart_and_a_client_waits_out_a_short_outage(valkey):
    client = connect(valkey.url, RedisOptions(retry_deadline_s=30.0))
    try:
        sessions = SessionStore(client, ttl_s=600)
        session = await sessions.create("You are terse.", '{"voice": "joe"}')
        await sessions.append(session, Exchange("Hi", "Hello."))
        turn = await TurnStore(client).create(session)
        await TokenStreamWriter(client, turn).append(TokenEntry(0, (7,), "Hello.", 1, 1, end=True,
                                                                finish_reason="eos"))
        valkey.stop_server()
        outage = asyncio.create_task(sessions.require(session))  # retries while Redis is down
        await asyncio.sleep(1.0)
        await asyncio.to_thread(valkey.start)
        assert (await outage)["system_prompt"] == "You are terse."
        assert await sessions.history(session) == (Exchange("Hi", "Hello."),)
        assert 0 < await client.ttl(session_key(session)) <= 600  # expiry survives too
        await TurnStore(client).require(turn, session)
        assert [e.text async for e in read_token_stream(client, turn, timeout_s=1)] == ["Hello."]
    finally:
        await client.aclose()


async def test_a_call_past_the_deadline_raises_an_error_naming_redis_then_the_client_recovers(valkey):
    client = connect(valkey.url, RedisOptions(retry_deadline_s=0.5))
    try:
        await client.set("k", "v")
        valkey.stop_server()
        with pytest.raises(RedisUnavailableError, match=rf"redis unreachable at {re.escape(valkey.display_url)} after"):
            await client.get("k")
        valkey.start()
        assert await client.get("k") == "v"
    finally:
        await client.aclose()


def test_one_data_directory_serves_one_valkey(valkey):
    with pytest.raises(RuntimeError, match="in use by another embedded valkey-server"):
        EmbeddedRedis(data_dir=valkey.data_dir).start()
    valkey.stop()
    with EmbeddedRedis(data_dir=valkey.data_dir) as again:  # released at stop
        assert again.data_dir == valkey.data_dir


# -- the four services ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack_valkey(tmp_path_factory):
    with EmbeddedRedis(data_dir=tmp_path_factory.mktemp("faults-valkey")) as server:
        yield server


@pytest.fixture(scope="module")
def fault_stack(stack_valkey, tmp_path_factory):
    env = {"SPECVOX_REDIS__RETRY_DEADLINE_S": str(DEADLINE_S)}
    with specvox_up(stack_valkey.url, tmp_path_factory.mktemp("faults-stack"), env) as addresses:
        yield addresses


@pytest.fixture
async def stubs(fault_stack):
    channels = [grpc.aio.insecure_channel(fault_stack[name]) for name in ("gateway", "llm", "tts")]
    yield (gw_grpc.GatewayStub(channels[0]), llm_grpc.LlmStub(channels[1]), tts_grpc.TtsStub(channels[2]))
    for channel in channels:
        await channel.close()


@pytest.fixture
async def stores(fault_stack):
    client = connect(fault_stack["redis"], RedisOptions(retry_deadline_s=30.0))
    yield SessionStore(client), TurnStore(client)
    await client.aclose()


async def _texts(entries) -> list[str]:
    return [e.text async for e in entries]


async def _speech(call) -> list:
    return [e async for e in call]


def _cue_text(events) -> str:
    return " ".join(e.cue.text for e in events if e.WhichOneof("event") == "cue")


async def _ready(gateway, session_id: str) -> list[str]:
    """A Converse on the session: its stored config is read, silence answers nothing."""
    start = gw.ClientMessage(start=gw.StreamStart(session_id=session_id, format=common.AudioFormat(
        encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1, sample_width_bytes=2)))
    silence = gw.ClientMessage(audio=b"\x00" * 3200)
    return [e.WhichOneof("event") async for e in gateway.Converse(iter([start, silence]))]


@pytest.mark.e2e
async def test_a_session_its_history_and_its_token_log_survive_a_restart(stubs, stores, stack_valkey):
    gateway, llm_stub, tts_stub = stubs
    sessions, turns = stores
    session_id = (await gateway.CreateSession(gw.CreateSessionRequest(system_prompt="You are terse."))).session_id
    turn = await turns.create(session_id)
    steps = [s async for s in llm_stub.Reply(llm.ReplyRequest(session_id=session_id, turn_id=turn,
                                                              user_text="Hi!", max_new_tokens=8))]
    reply = "".join(s.text_delta for s in steps)
    history = await sessions.history(session_id)
    assert history[-1] == Exchange("Hi!", reply.strip())

    await asyncio.to_thread(stack_valkey.restart)

    assert (await sessions.require(session_id))["system_prompt"] == "You are terse."
    assert await sessions.history(session_id) == history
    assert "".join(await _texts(read_token_stream(sessions.redis, turn, timeout_s=1))) == reply
    # The services' own connections were cut: each reconnects on its next call.
    spoken = await _speech(tts_stub.SpeakTurn(tts.SpeakTurnRequest(session_id=session_id, turn_id=turn)))
    assert normalised_text(_cue_text(spoken)) == normalised_text(reply)
    assert await _ready(gateway, session_id) == ["ready"]
    assert (await gateway.CreateSession(gw.CreateSessionRequest())).session_id


@pytest.mark.e2e
async def test_redis_down_past_the_deadline_is_unavailable_then_the_same_services_serve_again(
        stubs, stores, stack_valkey):
    gateway, llm_stub, tts_stub = stubs
    sessions, turns = stores
    session_id = (await gateway.CreateSession(gw.CreateSessionRequest())).session_id
    turn = await turns.create(session_id)

    stack_valkey.stop_server()
    try:
        details = await expect_status(grpc.StatusCode.UNAVAILABLE, "", gateway.CreateSession(gw.CreateSessionRequest()))
        assert f"redis unreachable at {stack_valkey.display_url} after" in details, details  # its password masked
        assert stack_valkey.password not in details
        for call in (llm_stub.Reply(llm.ReplyRequest(session_id=session_id, turn_id=turn, user_text="Hi!")),
                     tts_stub.SpeakTurn(tts.SpeakTurnRequest(session_id=session_id, turn_id=turn))):
            await expect_status(grpc.StatusCode.UNAVAILABLE, "redis unreachable", call)
    finally:
        await asyncio.to_thread(stack_valkey.start)

    assert await _ready(gateway, session_id) == ["ready"]
    steps = [s async for s in llm_stub.Reply(llm.ReplyRequest(session_id=session_id, turn_id=turn,
                                                              user_text="Hi!", max_new_tokens=6))]
    assert steps[-1].end and steps[-1].finish_reason in ("eos", "length")
    assert (await gateway.CreateSession(gw.CreateSessionRequest())).session_id


@pytest.mark.e2e
async def test_a_restart_in_the_middle_of_a_turn_is_ridden_out_and_the_turn_completes(
        stubs, stores, stack_valkey):
    gateway, llm_stub, tts_stub = stubs
    sessions, turns = stores
    session_id = (await gateway.CreateSession(gw.CreateSessionRequest())).session_id
    turn = await turns.create(session_id)
    speech = asyncio.create_task(_speech(tts_stub.SpeakTurn(tts.SpeakTurnRequest(
        session_id=session_id, turn_id=turn, sample_rate_hz=16_000))))
    steps = []
    async for step in llm_stub.Reply(llm.ReplyRequest(session_id=session_id, turn_id=turn, user_text=STORY,
                                                      max_new_tokens=64)):
        steps.append(step)
        if len(steps) == 1:
            assert not step.end  # so the rest of the reply is written, and read, across the restart
            await asyncio.to_thread(stack_valkey.restart)
    reply = "".join(s.text_delta for s in steps)

    assert steps[-1].end and steps[-1].finish_reason in ("eos", "length")
    assert [s.seq for s in steps] == list(range(len(steps)))
    spoken = await asyncio.wait_for(speech, 120)
    assert spoken[-1].WhichOneof("event") == "times"
    assert normalised_text(_cue_text(spoken)) == normalised_text(reply)  # every phrase once, none lost
    assert "".join(await _texts(read_token_stream(sessions.redis, turn, timeout_s=1))) == reply
    assert (await sessions.history(session_id))[-1] == Exchange(STORY, reply.strip())


@pytest.mark.e2e
async def test_redis_down_in_the_middle_of_a_turn_fails_it_unavailable_and_the_session_survives(
        stubs, stores, stack_valkey):
    gateway, llm_stub, tts_stub = stubs
    sessions, turns = stores
    session_id = (await gateway.CreateSession(gw.CreateSessionRequest())).session_id
    turn = await turns.create(session_id)
    speech = tts_stub.SpeakTurn(tts.SpeakTurnRequest(session_id=session_id, turn_id=turn))
    reply = aiter(llm_stub.Reply(llm.ReplyRequest(session_id=session_id, turn_id=turn, user_text=STORY,
                                                  max_new_tokens=64)))
    try:
        first = await anext(reply)
        assert not first.end
        stack_valkey.stop_server()
        await expect_status(grpc.StatusCode.UNAVAILABLE, "redis unreachable", reply)
        await expect_status(grpc.StatusCode.UNAVAILABLE, "redis unreachable", speech)
    finally:
        await asyncio.to_thread(stack_valkey.start)

    assert await sessions.history(session_id) == ()  # the failed reply was never heard
    assert await _ready(gateway, session_id) == ["ready"]
    again = await turns.create(session_id)
    steps = [s async for s in llm_stub.Reply(llm.ReplyRequest(session_id=session_id, turn_id=again,
                                                              user_text="Hi!", max_new_tokens=6))]
    assert steps[-1].end and (await sessions.history(session_id))[-1].user == "Hi!"
