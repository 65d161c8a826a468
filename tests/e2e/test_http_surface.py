"""The gateway's HTTP surface itself (services/gateway/web.py), on a real gateway: what every route shares.

API keys as OpenAI clients send them (and as a browser's WebSocket must), refusals in OpenAI's JSON
shape with the status the native API's would map to, the per-key rate, the body limit, an open
health check, a port that cannot be bound named in the error, and the WebSockets closed with 1001
when the gateway drains. Only the drain needs the stages (a Realtime session is made on them).
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from services.server.auth import AuthOptions, hash_key
from services.server.limits import LimitOptions
from services.server.runtime import CannotListen
from services.settings import Settings
from services.stack import free_port
from tests.inprocess import serve_one

KEY = "svk_http-surface-test-key-00000000000000"
OTHER_KEY = "svk_http-surface-other-key-0000000000000"

pytestmark = pytest.mark.e2e


def settings_for(redis_url: str, **update) -> Settings:
    keys = f"acme:{hash_key(KEY)},other:{hash_key(OTHER_KEY)}"
    return Settings(redis_url=redis_url, auth=AuthOptions(keys=keys), http_port=free_port(), gateway_port=free_port(),
                    http_max_body_bytes=64 * 1024,
                    limits=LimitOptions(requests_per_s_per_key=0.01, burst_per_key=6), **update)


@pytest.fixture(scope="module")
async def gateway(redis_url):
    settings = settings_for(redis_url)
    async with serve_one(settings, "gateway"):
        yield f"http://127.0.0.1:{settings.http_port}"


def is_openai_error(body: dict, kind: str) -> bool:
    error = body.get("error", {})
    return error.get("type") == kind and bool(error.get("message")) and {"param", "code"} <= set(error)


async def test_health_answers_without_a_key(gateway):
    async with aiohttp.ClientSession() as http, http.get(f"{gateway}/health") as r:
        assert r.status == 200 and (await r.json()) == {"status": "ok"}


async def test_a_missing_or_wrong_key_is_401_in_openais_shape(gateway):
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer svk_not-a-key"}, {"Authorization": f"Basic {KEY}"}):
            async with http.get(f"{gateway}/v1/models", headers=headers) as r:
                body = await r.json()
                assert r.status == 401, (headers, body)
                assert is_openai_error(body, "authentication_error"), body
                assert "Authorization: Bearer" in body["error"]["message"] or "not a valid" in body["error"]["message"]


async def test_unknown_routes_and_methods_are_openai_errors(gateway):
    headers = {"Authorization": f"Bearer {OTHER_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(f"{gateway}/v1/no-such-thing") as r:
            body = await r.json()
            assert r.status == 404 and is_openai_error(body, "not_found_error"), body
            assert "/v1/no-such-thing" in body["error"]["message"]
        async with http.delete(f"{gateway}/health") as r:
            body = await r.json()
            assert r.status == 405 and is_openai_error(body, "invalid_request_error"), body


async def test_a_body_past_the_limit_is_413_naming_the_setting(gateway):
    headers = {"Authorization": f"Bearer {OTHER_KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(f"{gateway}/v1/chat/completions", data=b"x" * (65 * 1024)) as r:
            body = await r.json()
            assert r.status == 413, body
            assert "http_max_body_bytes" in body["error"]["message"], body
        async with http.get(f"{gateway}/health") as r:  # still serving
            assert r.status == 200


async def test_the_key_subprotocol_authenticates_a_browser_websocket(gateway):
    """The key as `openai-insecure-api-key.<key>` is accepted where no header can be set; a wrong one is not."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gateway}/v1/models",
                            headers={"Sec-WebSocket-Protocol": f"realtime, openai-insecure-api-key.{OTHER_KEY}"}) as r:
            assert r.status != 401, await r.text()
        async with http.get(f"{gateway}/v1/models",
                            headers={"Sec-WebSocket-Protocol": "realtime, openai-insecure-api-key.svk_wrong"}) as r:
            assert r.status == 401


async def test_the_per_key_rate_is_429_for_that_key_only(gateway):
    async with aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(10):
            async with http.get(f"{gateway}/health-not", headers={"Authorization": f"Bearer {KEY}"}) as r:
                statuses.append(r.status)
                if r.status == 429:
                    body = await r.json()
                    assert is_openai_error(body, "rate_limit_error"), body
                    assert "limits.requests_per_s_per_key" in body["error"]["message"]
        assert 429 in statuses and statuses[0] == 404, statuses  # a burst of 6, then refused
        async with http.get(f"{gateway}/health-not", headers={"Authorization": f"Bearer {OTHER_KEY}"}) as r:
            assert r.status == 404  # another key is under its own rate


async def test_the_pages_files_load_past_any_keys_rate(gateway):
    """The browser page's files are served without a key and count against no tenant's rate (a burst of 6 here):
    a page loads its dozen files at once."""
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            for path in ("/", "/static/app.js", "/static/face.js", "/static/style.css"):
                async with http.get(f"{gateway}{path}") as r:
                    assert r.status == 200, (path, r.status)


async def test_a_taken_http_port_fails_the_start_naming_the_setting(redis_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = settings_for(redis_url).model_copy(update={"http_port": taken.getsockname()[1]})
        with pytest.raises(CannotListen, match="http_port"):
            async with serve_one(settings, "gateway"):
                pass


async def test_a_drain_closes_open_websockets_with_1001(stack):
    """A second gateway on the stack's stages and Valkey, a Realtime WebSocket open on it, then its drain:
    the client is told 1001 (going away), so it reconnects elsewhere, rather than seeing the connection drop."""
    settings = settings_for(stack["redis"]).model_copy(update={
        "asr_address": stack["asr"], "llm_address": stack["llm"], "tts_address": stack["tts"]})
    url = f"ws://127.0.0.1:{settings.http_port}/v1/realtime"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {OTHER_KEY}"}) as http:
        async with serve_one(settings, "gateway"):
            ws = await http.ws_connect(url)
            first = await asyncio.wait_for(ws.receive_json(), 30)
            assert first["type"] == "session.created", first
            reader = asyncio.create_task(_read_until_closed(ws))  # answers the server's close frame
        message = await asyncio.wait_for(reader, 30)  # the block's end drained the gateway
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), message
        assert ws.close_code == 1001, ws.close_code


async def _read_until_closed(ws: aiohttp.ClientWebSocketResponse) -> aiohttp.WSMessage:
    while (message := await ws.receive()).type == aiohttp.WSMsgType.TEXT:
        pass
    return message
