"""TLS on real servers on loopback, with certificates made here (tests/certs.py): gRPC server
TLS and mutual TLS refusing plaintext, wrong-CA and certificate-less clients; Redis over TLS
(rediss://) with an ACL password; the embedded Valkey refusing a client without its password."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import aiohttp
import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.exceptions import AuthenticationError, ResponseError

from services.channels import open_channel
from services.server import hooks
from services.settings import Settings
from services.store.client import RedisOptions, RedisUnavailableError, connect
from services.store.embedded import EmbeddedRedis
from services.tls import TlsOptions, redis_tls_kwargs
from tests.certs import Authority
from tests.grpc_status import status_code


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca, other = Authority(folder / "ca"), Authority(folder / "other", "another CA")
    return {"ca": ca, "other": other, "server": ca.issue("server"), "client": ca.issue("client"),
            "stranger": other.issue("stranger")}


@contextlib.asynccontextmanager
async def health_server(settings: Settings, service: str = "llm"):
    server = grpc.aio.server(interceptors=hooks.server_interceptors(settings, service))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = hooks.add_port(server, "127.0.0.1:0", settings, service)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def https_health(address: str, tls: TlsOptions | None) -> int:
    """The gateway's HTTP /health over HTTPS, presenting `tls`'s client certificate (None: none)."""
    context = ssl.create_default_context(cafile=str(tls.ca_file)) if tls else ssl.create_default_context()
    if tls is not None:
        context.load_cert_chain(tls.client_cert_file, tls.client_key_file)
    async with aiohttp.ClientSession() as session, session.get(f"https://{address}/health", ssl=context) as r:
        return r.status


async def check(address: str, tls: TlsOptions | None = None) -> grpc.StatusCode:
    async with open_channel(address, tls=tls) as channel:
        return await status_code(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5))


async def test_server_tls_refuses_plaintext_and_wrong_ca(pki):
    server = TlsOptions(cert_file=str(pki["server"].cert), key_file=str(pki["server"].key))
    async with health_server(Settings(tls=server)) as address:
        assert await check(address, TlsOptions(ca_file=str(pki["ca"].ca_file))) == grpc.StatusCode.OK
        assert await check(address) == grpc.StatusCode.UNAVAILABLE  # plaintext: no TLS handshake
        assert await check(address, TlsOptions(ca_file=str(pki["other"].ca_file))) == grpc.StatusCode.UNAVAILABLE
        # the right CA, the wrong name: the certificate is for localhost and 127.0.0.1 only
        wrong_name = TlsOptions(ca_file=str(pki["ca"].ca_file), server_name="gateway.example")
        assert await check(address, wrong_name) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_clients_without_a_certificate_of_the_ca(pki):
    server = TlsOptions(cert_file=str(pki["server"].cert), key_file=str(pki["server"].key),
                        client_ca_file=str(pki["ca"].ca_file))
    ca = str(pki["ca"].ca_file)
    async with health_server(Settings(tls=server)) as address:
        client = TlsOptions(ca_file=ca, client_cert_file=str(pki["client"].cert),
                            client_key_file=str(pki["client"].key))
        assert await check(address, client) == grpc.StatusCode.OK
        assert await check(address, TlsOptions(ca_file=ca)) == grpc.StatusCode.UNAVAILABLE  # no certificate
        stranger = TlsOptions(ca_file=ca, client_cert_file=str(pki["stranger"].cert),
                              client_key_file=str(pki["stranger"].key))
        assert await check(address, stranger) == grpc.StatusCode.UNAVAILABLE  # signed by another CA
        assert await check(address) == grpc.StatusCode.UNAVAILABLE


def test_tls_settings_checked():
    with pytest.raises(ValueError, match="go together"):
        TlsOptions(cert_file="a.crt")
    with pytest.raises(ValueError, match="mutual TLS"):
        TlsOptions(client_ca_file="ca.pem")
    with pytest.raises(ValueError, match="rediss://"):
        redis_tls_kwargs("redis://h:6379/0", ca_file="ca.pem")


async def test_embedded_valkey_refuses_a_client_without_its_password():
    with EmbeddedRedis() as server:
        assert server.password and server.password not in server.display_url
        good = connect(server.url)
        assert await good.ping()
        bare = aioredis.from_url(f"redis://127.0.0.1:{server.port}/0")
        with pytest.raises((AuthenticationError, ResponseError)):
            await bare.set("sv:stolen", "1")
        wrong = aioredis.from_url(f"redis://:wrong@127.0.0.1:{server.port}/0")
        with pytest.raises(AuthenticationError):
            await wrong.ping()
        assert not await good.exists("sv:stolen")
        with pytest.raises(OSError):  # bound to loopback only: not on the machine's other addresses
            await asyncio.open_connection(_non_loopback_address(), server.port)
        for client in (good, bare, wrong):
            await client.aclose()


def _non_loopback_address() -> str:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent by a UDP connect
            address = s.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    return address


@contextlib.asynccontextmanager
async def tls_front(pki, backend_port: int, require_client_cert: bool):
    """A TLS endpoint in front of the Valkey (the embedded build has no TLS): what a managed
    rediss:// Redis is to its clients. Bytes pass through both ways."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki["server"].cert, pki["server"].key)
    if require_client_cert:
        context.load_verify_locations(pki["ca"].ca_file)
        context.verify_mode = ssl.CERT_REQUIRED

    async def pipe(reader, writer):
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(client_reader, client_writer):
        backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", backend_port)
        await asyncio.gather(pipe(client_reader, backend_writer), pipe(backend_reader, client_writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_redis_over_tls_with_a_password(pki):
    with EmbeddedRedis(password="acl-secret") as valkey:
        async with tls_front(pki, valkey.port, require_client_cert=True) as port:
            url = f"rediss://127.0.0.1:{port}/0"
            options = RedisOptions(password="acl-secret", ssl_ca_file=str(pki["ca"].ca_file),
                                   ssl_cert_file=str(pki["client"].cert), ssl_key_file=str(pki["client"].key),
                                   retry_deadline_s=1.0)
            client = connect(url, options)
            await client.set("sv:tls", "yes")
            assert await client.get("sv:tls") == "yes"
            await client.aclose()
            for refused in (
                RedisOptions(password="acl-secret", ssl_ca_file=str(pki["other"].ca_file), retry_deadline_s=0.5),
                RedisOptions(password="acl-secret", ssl_ca_file=str(pki["ca"].ca_file), retry_deadline_s=0.5),
            ):  # a server certificate of another CA; no client certificate
                client = connect(url, refused)
                with pytest.raises((RedisUnavailableError, OSError, ssl.SSLError)):
                    await client.ping()
                await client.aclose()
            client = connect(url, RedisOptions(password="wrong", ssl_ca_file=str(pki["ca"].ca_file),
                                               ssl_cert_file=str(pki["client"].cert),
                                               ssl_key_file=str(pki["client"].key), retry_deadline_s=0.5))
            with pytest.raises(AuthenticationError):
                await client.ping()
            await client.aclose()


@pytest.mark.e2e
async def test_the_four_services_over_mutual_tls(pki, redis_url, speech):
    """Every port of the four real services on mutual TLS (in this process, tests/inprocess.py):
    plaintext and another CA's clients refused at each; a spoken turn through the gateway with
    the right certificate and key (so the gateway's hops to asr, llm and tts are mutual TLS too)."""
    from pipeline.audio import PcmFormat, float_to_pcm16
    from services.client import ClientOptions, Say, converse_script
    from services.server.auth import AuthOptions, hash_key
    from tests.inprocess import ORDER, four_services

    key = "svk_the-tls-test-key-00000000000000000000000"
    server = TlsOptions(cert_file=str(pki["server"].cert), key_file=str(pki["server"].key),
                        client_ca_file=str(pki["ca"].ca_file), ca_file=str(pki["ca"].ca_file))
    settings = Settings(redis_url=redis_url, tls=server,
                        auth=AuthOptions(keys=f"acme:{hash_key(key)}", service_token="cluster-secret"))
    client = TlsOptions(ca_file=str(pki["ca"].ca_file), client_cert_file=str(pki["client"].cert),
                        client_key_file=str(pki["client"].key))
    stranger = TlsOptions(ca_file=str(pki["ca"].ca_file), client_cert_file=str(pki["stranger"].cert),
                          client_key_file=str(pki["stranger"].key))
    async with four_services(settings) as addresses:
        assert await https_health(addresses["http"], client) == 200  # the HTTP surface: the same certificates
        for refused in (None, stranger):
            with pytest.raises(aiohttp.ClientError):
                await https_health(addresses["http"], refused)
        for name in ORDER:
            address = addresses[name]
            assert await check(address) == grpc.StatusCode.UNAVAILABLE, name
            assert await check(address, stranger) == grpc.StatusCode.UNAVAILABLE, name
            assert await check(address, client) == grpc.StatusCode.OK, name  # health: open by default
        question = Say(float_to_pcm16(speech("What is the capital of France?")))
        turns = await converse_script(addresses["gateway"], [question], PcmFormat(16_000, 1, 2),
                                      ClientOptions(api_key=key, tls=client))
    report = next(t.report for t in turns if t.report)
    assert report["reply_text"].strip() and report["finish_reason"] in ("eos", "length"), report


async def test_redis_acl_user():
    """An ACL user and password from RedisOptions (redis.username, redis.password): it reaches the
    `sv:` keys it is granted and nothing else; a wrong password is refused."""
    from redis.exceptions import NoPermissionError

    with EmbeddedRedis() as valkey:
        admin = connect(valkey.url)
        await admin.execute_command("ACL", "SETUSER", "specvox", "on", ">user-secret", "~sv:*", "+@all")
        url = f"redis://127.0.0.1:{valkey.port}/0"
        user = connect(url, RedisOptions(username="specvox", password="user-secret", retry_deadline_s=0.5))
        await user.set("sv:acl", "ok")
        assert await user.get("sv:acl") == "ok"
        with pytest.raises(NoPermissionError):
            await user.set("other:key", "no")
        wrong = connect(url, RedisOptions(username="specvox", password="nope", retry_deadline_s=0.5))
        with pytest.raises(AuthenticationError):
            await wrong.ping()
        for client in (admin, user, wrong):
            await client.aclose()


def test_metrics_endpoint_under_mutual_tls_wants_a_client_certificate_of_the_ca(pki):
    """/metrics is HTTPS with the service's certificate, and under mutual TLS a scraper without a
    certificate, or with one of another CA, is refused in the handshake; the right one scrapes."""
    import urllib.request

    from services.server.metrics import start_endpoint
    from services.stack import free_port

    tls = TlsOptions(cert_file=str(pki["server"].cert), key_file=str(pki["server"].key),
                     client_ca_file=str(pki["ca"].ca_file))
    port = start_endpoint(Settings(tls=tls, metrics_port=free_port(), host="127.0.0.1"), "test")

    def scrape(client=None) -> str:
        context = ssl.create_default_context(cafile=str(pki["ca"].ca_file))
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=context, timeout=10) as response:
            return response.read().decode()

    assert "specvox_requests_total" in scrape(pki["client"])
    for stranger in (None, pki["stranger"]):
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            scrape(stranger)


async def test_specvox_health_checks_a_service_over_its_tls_with_the_service_credential(pki):
    """The container health check (`specvox health ADDRESS`, docker/compose.yaml) speaks the stack's
    TLS and presents the service credential: SERVING exits 0; without the CA it cannot connect (1)."""
    import os
    import sys

    from services.server.auth import AuthOptions

    server = TlsOptions(cert_file=str(pki["server"].cert), key_file=str(pki["server"].key))
    settings = Settings(tls=server, auth=AuthOptions(mode="on", service_token="cluster", open_health=False))

    async def health(address: str, **env: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "health", address, env=dict(os.environ, **env),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await process.communicate()
        return process.returncode, out.decode()

    async with health_server(settings) as address:
        trusted = {"SPECVOX_TLS__CA_FILE": str(pki["ca"].ca_file), "SPECVOX_AUTH__SERVICE_TOKEN": "cluster"}
        code, out = await health(address, **trusted)
        assert code == 0 and "SERVING" in out, out
        code, out = await health(address, SPECVOX_AUTH__SERVICE_TOKEN="cluster")  # plaintext to a TLS port
        assert code == 1, out
        code, out = await health(address, SPECVOX_TLS__CA_FILE=str(pki["ca"].ca_file))  # no credential
        assert code == 1, out
