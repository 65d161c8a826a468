"""API keys and the service credential on real gRPC servers on loopback (services/server/auth.py).

The loopback servers here carry health and reflection with the same interceptors every specvox
server gets (services/server/hooks.py); the stack test at the end runs the four real services.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from services.channels import open_channel
from services.server import auth, hooks
from services.server.auth import AuthOptions, KeyRing, add_key, hash_key, read_key_file, revoke
from services.settings import Settings
from tests.grpc_status import status_code

GATEWAY_KEY = "svk_test-key-of-tenant-acme-000000000000000"


async def _server(settings: Settings, service: str):
    """health + reflection behind the service's interceptors, on a free loopback port."""
    server = grpc.aio.server(interceptors=hooks.server_interceptors(settings, service))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = hooks.add_port(server, "127.0.0.1:0", settings, service)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _reflect(channel, metadata=None) -> grpc.StatusCode:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return await status_code(stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata))


async def _health(channel) -> grpc.StatusCode:
    return await status_code(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5))


def test_key_file_keeps_hashes_only_and_rejects_bad_lines(tmp_path):
    path = tmp_path / "keys"
    key = add_key(path, "acme")
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    assert read_key_file(path) == [("acme", hash_key(key))]
    assert (path.stat().st_mode & 0o777) == 0o600
    path.write_text("acme:nothex\n")
    with pytest.raises(auth.AuthConfigError, match="keys:1"):
        KeyRing(AuthOptions(keys_file=str(path)))


def test_rotation_without_restart(tmp_path):
    """A key added to the file is accepted and a revoked one refused by the same KeyRing."""
    path = tmp_path / "keys"
    old = add_key(path, "acme")
    ring = KeyRing(AuthOptions(keys_file=str(path)))
    assert ring.tenant(old) == "acme"
    new = add_key(path, "acme")
    assert ring.tenant(new) == "acme"
    assert revoke(path, hash_key(old)[:12]) == 1
    assert ring.tenant(old) is None and ring.tenant(new) == "acme"
    path.write_text("garbage\n")  # a broken file keeps the last good keys
    assert ring.tenant(new) == "acme"


def test_auth_off_without_keys():
    settings = Settings()
    assert auth.authenticator(settings.auth, "gateway") is None
    assert auth.authenticator(settings.auth, "llm") is None
    with pytest.raises(auth.AuthConfigError, match="service_token"):
        auth.authenticator(AuthOptions(mode="on"), "llm")
    assert "auth OFF" in auth.describe(settings.auth, "gateway", None)  # what a service logs at start
    on = AuthOptions(keys=f"acme:{hash_key(GATEWAY_KEY)}")
    assert "auth ON" in auth.describe(on, "gateway", auth.authenticator(on, "gateway"))


async def test_gateway_refuses_missing_and_wrong_keys(tmp_path):
    settings = Settings(auth=AuthOptions(keys=f"acme:{hash_key(GATEWAY_KEY)}", service_token="cluster-secret"))
    server, address = await _server(settings, "gateway")
    try:
        async with open_channel(address) as none, open_channel(address, secret="svk_wrong") as wrong, \
                open_channel(address, secret=GATEWAY_KEY) as right, \
                open_channel(address, secret="cluster-secret") as cluster:
            assert await _reflect(none) == grpc.StatusCode.UNAUTHENTICATED
            assert await _reflect(wrong) == grpc.StatusCode.UNAUTHENTICATED
            assert await _reflect(right) == grpc.StatusCode.OK
            assert await _reflect(cluster) == grpc.StatusCode.OK
            assert await _health(none) == grpc.StatusCode.OK  # auth.open_health (default)
            basic = (("authorization", "Basic " + GATEWAY_KEY),)  # the right key, not as a bearer credential
            assert await _reflect(none, basic) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)


async def test_closed_health_and_open_reflection(tmp_path):
    settings = Settings(auth=AuthOptions(keys=f"acme:{hash_key(GATEWAY_KEY)}", open_health=False,
                                         open_reflection=True))
    server, address = await _server(settings, "gateway")
    try:
        async with open_channel(address) as none, open_channel(address, secret=GATEWAY_KEY) as right:
            assert await _health(none) == grpc.StatusCode.UNAUTHENTICATED
            assert await _health(right) == grpc.StatusCode.OK
            assert await _reflect(none) == grpc.StatusCode.OK
    finally:
        await server.stop(None)


async def test_internal_service_takes_only_the_service_credential():
    settings = Settings(auth=AuthOptions(keys=f"acme:{hash_key(GATEWAY_KEY)}", service_token="cluster-secret"))
    server, address = await _server(settings, "llm")
    try:
        async with open_channel(address) as none, open_channel(address, secret=GATEWAY_KEY) as tenant, \
                open_channel(address, secret="cluster-secret") as cluster:
            assert await _reflect(none) == grpc.StatusCode.UNAUTHENTICATED
            assert await _reflect(tenant) == grpc.StatusCode.UNAUTHENTICATED  # a tenant's key is no use inside
            assert await _reflect(cluster) == grpc.StatusCode.OK
    finally:
        await server.stop(None)


def test_service_token_generated_once(tmp_path):
    first = auth.ensure_service_token(AuthOptions(), tmp_path)
    assert len(first) >= 40 and (tmp_path / "service_token").stat().st_mode & 0o777 == 0o600
    assert auth.ensure_service_token(AuthOptions(), tmp_path) == first
    assert auth.ensure_service_token(AuthOptions(service_token="set"), tmp_path) == "set"


# -- the four real services under `specvox up` --------------------------------------------------

def _calls(module, service_name: str):
    """(method name, whether it takes a request stream, an empty request) for every method of a service."""
    from google.protobuf.message_factory import GetMessageClass

    for method in module.DESCRIPTOR.services_by_name[service_name].methods:
        request = GetMessageClass(method.input_type)()
        yield method.name, method.client_streaming, request


async def _status(channel, grpc_module, service_name: str, method: str, client_streaming: bool,
                  request) -> grpc.StatusCode:
    stub = getattr(grpc_module, f"{service_name}Stub")(channel)
    # A request stream sends nothing: an asyncio client whose write races the server's refusal may
    # report INTERNAL "Internal error from Core" instead of the server's status (grpc/grpc#36066).
    return await status_code(getattr(stub, method)(iter([]) if client_streaming else request, timeout=30))


@pytest.mark.e2e
async def test_every_method_of_every_service_refuses_missing_and_wrong_credentials(redis_url, tmp_path, speech):
    """Keys enforced under `specvox up`: no key, a wrong one, a tenant's key at an internal
    service: UNAUTHENTICATED on every method; the tenant's key at the gateway makes a real turn
    (so the gateway's hops carry the cluster credential `up` generated)."""
    from pipeline.audio import PcmFormat, float_to_pcm16
    from services.client import ClientOptions, Say, converse_script
    from services.protos import load
    from tests.conftest import specvox_up

    keys = tmp_path / "keys"
    key = add_key(keys, "acme")
    from services.stack import PORT_SPAN, free_ports

    metrics_port = free_ports(PORT_SPAN)  # up gives the gateway this port, asr, llm and tts the next three
    env = {"SPECVOX_AUTH__KEYS_FILE": str(keys), "SPECVOX_REDIS__DATA_DIR": str(tmp_path / "data" / "valkey"),
           "SPECVOX_METRICS_PORT": str(metrics_port)}
    with specvox_up(redis_url, tmp_path, env) as stack:
        token = (tmp_path / "data" / "service_token").read_text().strip()
        refused = []
        for name, service_name in (("gateway", "Gateway"), ("asr", "Asr"), ("llm", "Llm"), ("tts", "Tts")):
            module, grpc_module = load(name)
            secrets = {"none": "", "wrong": "svk_not-a-key", "tenant key" if name != "gateway" else "token":
                       key if name != "gateway" else token + "x"}
            for method, cs, request in _calls(module, service_name):
                for what, secret in secrets.items():
                    async with open_channel(stack[name], secret=secret) as channel:
                        code = await _status(channel, grpc_module, service_name, method, cs, request)
                    refused.append((name, method, what, code))
        wrong = [r for r in refused if r[3] != grpc.StatusCode.UNAUTHENTICATED]
        assert not wrong, wrong
        assert {(n, m) for n, m, _, _ in refused} >= {("gateway", "Converse"), ("llm", "Reply"),
                                                      ("tts", "SpeakTurn"), ("asr", "Transcribe")}
        # the service credential passes an internal service's auth (the call then fails on its empty request)
        llm, llm_grpc = load("llm")
        async with open_channel(stack["llm"], secret=token) as channel:
            capabilities = await llm_grpc.LlmStub(channel).Capabilities(llm.CapabilitiesRequest(), timeout=30)
        assert capabilities.drafters
        turns = await converse_script(stack["gateway"], [Say(float_to_pcm16(speech("What is the capital of France?")))],
                                      PcmFormat(16_000, 1, 2), ClientOptions(api_key=key, realtime=True))
        report = next(t.report for t in turns if t.report)
        await _another_tenant_cannot_use_the_session(stack["gateway"], key, add_key(keys, "beta"))
        _each_service_counted_its_refusals(metrics_port, refused)
        assert report["reply_text"].strip() and report["finish_reason"] in ("eos", "length"), \
            (report["finish_reason"], report.get("error"), report["transcript"])


def test_keys_command(tmp_path):
    """`specvox keys`: the key printed once, only its hash in the file, revoked by tenant."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    path = tmp_path / "keys"

    def keys(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", "keys", *args, "--file", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    added = keys("add", "acme")
    key = added.stdout.strip().splitlines()[-1]
    assert added.returncode == 0 and key.startswith("svk_") and key not in path.read_text()
    assert KeyRing(AuthOptions(keys_file=str(path))).tenant(key) == "acme"
    assert hash_key(key)[:12] in keys("list").stdout
    assert keys("revoke", "acme").returncode == 0
    assert keys("revoke", "acme").returncode == 1  # nothing left to revoke
    assert keys("add", "no spaces").returncode == 2


async def _another_tenant_cannot_use_the_session(gateway: str, owner_key: str, other_key: str) -> None:
    """Tenant isolation: beta's key on acme's session is answered exactly as an unknown session
    (NOT_FOUND, the same words), so beta learns nothing; acme still converses in it."""
    from services.protos import load, load_common

    gw, gw_grpc = load("gateway")
    common = load_common()
    fmt = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1,
                             sample_width_bytes=2)

    async def start(secret: str, session_id: str):
        async with open_channel(gateway, secret=secret) as channel:
            call = gw_grpc.GatewayStub(channel).Converse()
            await call.write(gw.ClientMessage(start=gw.StreamStart(session_id=session_id, format=fmt)))
            try:
                event = await call.read()
                call.cancel()
                return event.WhichOneof("event"), ""
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details().replace(session_id, "ID")

    async with open_channel(gateway, secret=owner_key) as channel:
        session_id = (await gw_grpc.GatewayStub(channel).CreateSession(gw.CreateSessionRequest())).session_id
    theirs = await start(other_key, session_id)
    unknown = await start(other_key, "0" * 32)
    assert theirs[0] == grpc.StatusCode.NOT_FOUND and theirs == unknown, (theirs, unknown)
    assert await start(owner_key, session_id) == ("ready", "")


def _each_service_counted_its_refusals(metrics_port: int, refused) -> None:
    """Each service's own /metrics (specvox up's ports) counts the UNAUTHENTICATED calls it answered."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    for offset, name in enumerate(("gateway", "asr", "llm", "tts")):
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + offset}/metrics", timeout=10).read().decode()
        counted = sum(sample.value for family in text_string_to_metric_families(body) for sample in family.samples
                      if sample.name == "specvox_requests_total" and sample.labels["service"] == name
                      and sample.labels["code"] == "UNAUTHENTICATED")
        assert counted == sum(1 for n, *_ in refused if n == name), name
