"""Each limit tripped on the real four services (in this process, tests/inprocess.py), answered
RESOURCE_EXHAUSTED with a message naming its setting, and the gateway still serving others."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pipeline.audio import PcmFormat, float_to_pcm16
from services.channels import open_channel
from services.client import ClientOptions, Say, converse_script
from services.protos import load, load_common
from services.server.auth import AuthOptions, hash_key
from services.server.limits import LimitOptions
from services.settings import Settings
from services.stack import free_port
from tests.grpc_status import expect_status, refusal
from tests.inprocess import four_services, serve_one

gw, gw_grpc = load("gateway")
common = load_common()
TENANTS = ("streams", "sessions", "rate", "tokens", "turns", "speech", "slow", "across", "rate-across", "lease",
           *(f"other{i}" for i in range(12)))
KEYS = {t: f"svk_key-of-{t}-000000000000000000000000" for t in TENANTS}
_others = iter(t for t in TENANTS if t.startswith("other"))


def another() -> str:
    """A tenant no test has used: it is under every limit."""
    return next(_others)
# max_queued_events: room for a reply's first burst (its text, word cues, and the visemes and audio of the
# lead ahead of playback: ~60 events) while this process also runs the four services' models.
LIMITS = LimitOptions(max_streams_per_key=1, max_sessions_per_key=2, requests_per_s_per_key=0.05, burst_per_key=30,
                      max_utterance_s=4.0, max_reply_tokens=48, max_turns_per_session=1, max_queued_events=200)
FORMAT = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1,
                            sample_width_bytes=2)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
async def stack(redis_url):
    keys = ",".join(f"{t}:{hash_key(k)}" for t, k in KEYS.items())
    settings = Settings(redis_url=redis_url, limits=LIMITS, auth=AuthOptions(keys=keys, service_token="cluster"))
    async with four_services(settings) as addresses:
        yield settings, addresses


@pytest.fixture(scope="module")
def gateway(stack):
    return stack[1]["gateway"]


@pytest.fixture(scope="module")
async def second_gateway(stack):
    """Another gateway process's worth: its own servicer and interceptors, the same Redis and workers."""
    settings, addresses = stack
    ports = {f"{name}_port": int(addresses[name].rsplit(":", 1)[1]) for name in ("asr", "llm", "tts")}
    async with serve_one(settings.model_copy(update={**ports, "gateway_port": free_port(), "http_port": free_port()}),
                         "gateway") as address:
        yield address


async def create(address: str, tenant: str, **config) -> str:
    async with open_channel(address, secret=KEYS[tenant]) as channel:
        session = await gw_grpc.GatewayStub(channel).CreateSession(
            gw.CreateSessionRequest(config=gw.SessionConfig(**config)), timeout=30)
    return session.session_id


async def refused(awaitable, limit: str) -> str:
    """The call ends RESOURCE_EXHAUSTED naming `limits.<limit>`; the details.

    A stream the server ends while the client is still sending audio may reach an asyncio
    client as INTERNAL "Internal error from Core" instead (grpc/grpc#36066, client side): then
    what the server answered is read from its own counters (this process's registry)."""
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value("specvox_limited_total", {"limit": limit}) or 0.0

    before = count()
    error = await refusal(awaitable)
    assert count() > before, (limit, error)  # the server refused it by this limit
    if error.code() == grpc.StatusCode.INTERNAL and error.details() == "Internal error from Core":
        return f"limits.{limit} (the client saw grpc/grpc#36066)"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert f"limits.{limit}" in error.details(), error
    return error.details()


async def open_stream(channel, session_id: str):
    """A Converse stream up to its `ready` event."""
    call = gw_grpc.GatewayStub(channel).Converse()
    await call.write(gw.ClientMessage(start=gw.StreamStart(session_id=session_id, format=FORMAT)))
    event = await call.read()
    assert event.WhichOneof("event") == "ready", event
    return call


async def test_concurrent_streams_per_key(gateway):
    other = another()
    first_session, second_session = await create(gateway, "streams"), await create(gateway, other)
    async with open_channel(gateway, secret=KEYS["streams"]) as channel:
        first = await open_stream(channel, first_session)
        details = await refused(open_stream(channel, first_session), "max_streams_per_key")
        assert "limits.max_streams_per_key" in details
        async with open_channel(gateway, secret=KEYS[other]) as channel2:  # another key streams meanwhile
            (await open_stream(channel2, second_session)).cancel()
        first.cancel()
        for _ in range(20):  # the slot frees once the server's handler has wound down
            try:
                (await open_stream(channel, first_session)).cancel()
                break
            except grpc.aio.AioRpcError as e:
                assert "limits.max_streams_per_key" in e.details(), e  # each try spends one of the burst's 30
                await asyncio.sleep(0.25)
        else:
            pytest.fail("the stream's slot was not given back")


async def test_sessions_per_key(gateway):
    await create(gateway, "sessions")
    await create(gateway, "sessions")
    details = await refused(create(gateway, "sessions"), "max_sessions_per_key")
    assert "limits.max_sessions_per_key" in details
    assert await create(gateway, another())


async def test_an_http_requests_own_session_counts_against_the_key_while_it_lasts(stack, gateway):
    """A chat completion makes a session of its own for its reply: with the key's sessions all held it is
    refused 429 naming the limit; with room it runs, and gives its session back when it is done."""
    import aiohttp

    base = f"http://{stack[1]['http']}/v1"

    async def chat(tenant: str) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            async with http.get(f"{base}/models") as response:
                model = (await response.json())["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}
            async with http.post(f"{base}/chat/completions", json=body) as response:
                return response.status, await response.json()

    full, roomy = another(), another()
    await create(gateway, full)
    await create(gateway, full)
    status, refusal_body = await chat(full)
    assert status == 429 and "limits.max_sessions_per_key" in refusal_body["error"]["message"], refusal_body
    await create(gateway, roomy)
    for _ in range(2):  # each request's session is given back: the second fits as the first did
        status, answer = await chat(roomy)
        assert status == 200 and answer["choices"][0]["message"]["content"], answer
    assert await create(gateway, roomy)  # and the key's second session still fits


async def test_requests_per_second_per_key(gateway):
    """A burst of 30 at 0.05/s: the 31st call within seconds is refused; another key is not.
    (Calls on an unknown session: each is a request, and none holds a session.)"""
    codes = []
    async with open_channel(gateway, secret=KEYS["rate"]) as channel:
        for _ in range(31):
            try:
                (await open_stream(channel, "no-such-session")).cancel()
            except grpc.aio.AioRpcError as e:
                codes.append(e.code().name)
                details = e.details()
    assert codes[:30] == ["NOT_FOUND"] * 30, codes
    assert codes[30] == "RESOURCE_EXHAUSTED" and "limits.requests_per_s_per_key" in details, codes
    assert await create(gateway, another())


async def test_streams_are_counted_across_gateways(gateway, second_gateway):
    """A key's one stream on the first gateway fills its slot on the second too; closed, it frees both."""
    session_id = await create(gateway, "across")
    async with open_channel(gateway, secret=KEYS["across"]) as first, \
            open_channel(second_gateway, secret=KEYS["across"]) as second:
        held = await open_stream(first, session_id)
        details = await refused(open_stream(second, session_id), "max_streams_per_key")
        assert "limits.max_streams_per_key" in details
        held.cancel()
        for _ in range(20):
            try:
                (await open_stream(second, session_id)).cancel()
                break
            except grpc.aio.AioRpcError as e:
                assert "limits.max_streams_per_key" in e.details(), e
                await asyncio.sleep(0.25)
        else:
            pytest.fail("the first gateway's stream did not give its slot back")


async def test_request_rate_is_shared_across_gateways(gateway, second_gateway, redis_url):
    """The burst of 30 is the key's, not each gateway's: 15 calls on each, then the 31st is refused on either.

    Each stream's lease (max_streams_per_key=1 here) is let go before the next opens: the server
    releases it after the client has its NOT_FOUND, and this test is about the rate alone."""
    from services.store.client import connect
    from services.store.keys import tenant_streams_key

    codes = []
    redis = connect(redis_url)
    try:
        async with open_channel(gateway, secret=KEYS["rate-across"]) as first, \
                open_channel(second_gateway, secret=KEYS["rate-across"]) as second:
            for i in range(32):
                try:
                    (await open_stream(first if i % 2 else second, "no-such-session")).cancel()
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code().name)
                for _ in range(200):
                    if not await redis.zcard(tenant_streams_key("rate-across")):
                        break
                    await asyncio.sleep(0.01)
    finally:
        await redis.aclose()
    assert codes[:30] == ["NOT_FOUND"] * 30, codes
    assert codes[30:] == ["RESOURCE_EXHAUSTED"] * 2, codes


async def test_a_dead_gateways_stream_frees_its_slot_when_its_lease_runs_out(gateway, redis_url):
    """A gateway killed with a stream open leaves its lease behind (no close ran): the key is refused
    until the lease's end, then served. The lease is written as that gateway's script wrote it."""
    from services.store.client import connect
    from services.store.keys import tenant_streams_key

    session_id = await create(gateway, "lease")
    redis = connect(redis_url)
    try:
        seconds, micros = await redis.time()
        await redis.zadd(tenant_streams_key("lease"), {"a-dead-gateway": seconds * 1000 + micros // 1000 + 1500})
        async with open_channel(gateway, secret=KEYS["lease"]) as channel:
            await refused(open_stream(channel, session_id), "max_streams_per_key")
            await asyncio.sleep(1.6)
            (await open_stream(channel, session_id)).cancel()
    finally:
        await redis.aclose()


async def test_reply_tokens(gateway):
    details = await refused(create(gateway, "tokens", max_reply_tokens=200), "max_reply_tokens")
    assert "limits.max_reply_tokens" in details
    async with open_channel(gateway, secret=KEYS["tokens"]) as channel:
        session = await gw_grpc.GatewayStub(channel).CreateSession(gw.CreateSessionRequest(), timeout=30)
    assert session.config.max_reply_tokens == 48  # the default, capped
    other = another()  # another tenant meanwhile: under the cap, asked for, given
    async with open_channel(gateway, secret=KEYS[other]) as channel:
        session = await gw_grpc.GatewayStub(channel).CreateSession(
            gw.CreateSessionRequest(config=gw.SessionConfig(max_reply_tokens=20)), timeout=30)
    assert session.config.max_reply_tokens == 20


async def _converse(gateway: str, tenant: str, session_id: str, texts: list[str], speech):
    says = [Say(float_to_pcm16(speech(t))) for t in texts]
    return await converse_script(gateway, says, PcmFormat(16_000, 1, 2),
                                 ClientOptions(api_key=KEYS[tenant], session_id=session_id, wait_for_replies=True))


async def test_conversation_length(gateway, speech):
    session_id = await create(gateway, "turns")
    details = await refused(_converse(gateway, "turns", session_id,
                                      ["What is the capital of France?", "And of Spain?"], speech),
                            "max_turns_per_session")
    assert "limits.max_turns_per_session" in details
    again = await refused(_converse(gateway, "turns", session_id, ["Hello?"], speech),  # the session stays full
                          "max_turns_per_session")
    assert "limits.max_turns_per_session" in again
    other = another()
    turns = await _converse(gateway, other, await create(gateway, other), ["Hello?"], speech)
    assert any(t.report for t in turns)


async def test_utterance_length(gateway, speech):
    long = ("Tell me everything you know about the long history of the city of Paris and the people "
            "who built its bridges and its streets over so many centuries")  # no comma: no pause, ~7 s
    details = await refused(_converse(gateway, "speech", await create(gateway, "speech"), [long], speech),
                            "max_utterance_s")
    assert "limits.max_utterance_s" in details
    # a short one from the same tenant, in a new session, is answered: the limit is per utterance
    turns = await _converse(gateway, "speech", await create(gateway, "speech"), ["Hello?"], speech)
    assert any(t.report for t in turns)


@pytest.fixture
async def small_queue_gateway(redis_url):
    """The gateway with only a small queue limit, so a reply left unread overflows it."""
    async with four_services(Settings(redis_url=redis_url, limits=LimitOptions(max_queued_events=10))) as addresses:
        yield addresses["gateway"]


async def test_a_client_that_stops_reading_is_cut_off(small_queue_gateway, speech):
    """The client sends a question and reads nothing (a small HTTP/2 window, no BDP growth): the
    gateway's queue for it stops at max_queued_events and the stream ends RESOURCE_EXHAUSTED
    once the client reads again; the gateway serves another stream meanwhile."""
    gateway = small_queue_gateway
    async with open_channel(gateway) as channel:
        stub = gw_grpc.GatewayStub(channel)
        session_id = (await stub.CreateSession(gw.CreateSessionRequest(), timeout=30)).session_id
        other_session = (await stub.CreateSession(gw.CreateSessionRequest(), timeout=30)).session_id
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    async with open_channel(gateway, options=options) as channel:
        call = await open_stream(channel, session_id)
        pcm = float_to_pcm16(speech("What is the capital of France?"))
        step = 3200  # 100 ms
        for i in range(0, len(pcm), step):
            await call.write(gw.ClientMessage(audio=pcm[i:i + step]))
            await asyncio.sleep(0.1)
        for _ in range(100):  # 10 s of microphone silence while the reply is made, unread
            await call.write(gw.ClientMessage(audio=bytes(step)))
            await asyncio.sleep(0.1)
        async with open_channel(gateway) as other:  # meanwhile another stream opens
            (await open_stream(other, other_session)).cancel()

        async def read_on() -> None:
            for _ in range(10_000):  # without the limit the stream would go on: the wait below fails it
                if await asyncio.wait_for(call.read(), 60) == grpc.aio.EOF:
                    break

        await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "limits.max_queued_events", read_on())
