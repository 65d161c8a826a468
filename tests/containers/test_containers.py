"""docker/: the image built and the compose stack brought up for real (podman and podman-compose here;
SPECVOX_ENGINE=docker SPECVOX_COMPOSE="docker compose" elsewhere), `make test-containers`.

Valkey with a password and AOF, asr, two llm and two tts replicas, the gateway; every service's
health check run as the engine runs it; a spoken turn through the published gateway port; an llm
container killed mid-reply and the turn finished by the other replica, token for token (as
tests/e2e/test_failover.py does with processes); the voice-to-voice histogram read from the
gateway's /metrics and from Prometheus (the monitoring profile's, Debian's package built on the same
base), which scrapes every replica by name. Grafana's image needs a registry and is not run here.
The build time, image size and time to a healthy stack go to test-artifacts/containers.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from pipeline.audio import PcmFormat, float_to_pcm16
from services.client import ClientOptions, Say, converse_script
from services.protos import load
from services.store.client import connect
from services.store.keys import turn_key, work_key
from services.store.turn_log import read_token_log
from tests.conftest import ROOT

pytestmark = pytest.mark.containers
gw, gw_grpc = load("gateway")
llm, llm_grpc = load("llm")
FMT = PcmFormat(16_000, 1, 2)
ENGINE = os.environ.get("SPECVOX_ENGINE", "podman")
COMPOSE = shlex.split(os.environ.get("SPECVOX_COMPOSE", str(ROOT / ".venv-containers" / "bin" / "podman-compose")))
BASE = os.environ.get("SPECVOX_BASE", "debian:bookworm-slim")
IMAGE = "localhost/specvox:latest"
GATEWAY_IMAGE = "localhost/specvox-gateway:latest"  # the slim one: no torch, no models
PROMETHEUS_IMAGE = "localhost/specvox-prometheus:latest"  # Debian's prometheus package
PROJECT = "specvoxtest"
STORY = "Tell me a long story about a brave little dragon."
CONFIG = {"max_reply_tokens": 72, "budget_ms": 60_000}  # nothing degraded: the plain greedy reply
SERVICES = {"redis": 1, "asr": 1, "llm": 2, "tts": 2, "gateway": 1}
ARTIFACTS = ROOT / "test-artifacts"
NICE = ["nice", "-n", "19", "ionice", "-c3"]  # builds and stacks beside other work on few cores


def run(*args: str, timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=check,
                          **kwargs)


def containers(service: str) -> list[str]:
    out = run(ENGINE, "ps", "--filter", f"label=com.docker.compose.project={PROJECT}",
              "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}").stdout
    return sorted(out.split())


def inspect(container: str, template: str) -> str:
    return run(ENGINE, "inspect", "--format", template, container).stdout.strip()


def ip_of(container: str) -> str:
    return inspect(container, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")


def healthy(container: str, tries: int = 1) -> bool:
    """The container's own health check, run as the engine runs it; `tries`: as many as the engine
    makes before it calls a container unhealthy (compose's retries), since one may time out on a busy box."""
    if ENGINE == "docker":
        return inspect(container, "{{.State.Health.Status}}") == "healthy"
    return any(run(ENGINE, "healthcheck", "run", container, check=False, timeout=60).returncode == 0
               for _ in range(tries))


def host_port() -> int:
    """A port the kernel deems free on every address (what the engine publishes on), from its ephemeral
    range: the test processes' port blocks (services/stack.use_port_block) are other runs' too."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def remove_project(base: list[str]) -> None:
    """compose down, and the containers it does not know of: podman-compose's down forgets the
    replicas of an `up --scale`."""
    run(*base, "down", "-t", "15", check=False, timeout=300)
    ids = run(ENGINE, "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
    if ids:
        run(ENGINE, "rm", "-f", *ids, check=False, timeout=120)
    run(*base, "down", "-v", check=False, timeout=300)


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    figures: dict[str, float | str] = {"engine": ENGINE, "base": BASE}
    started = time.monotonic()
    for target, image in (("", IMAGE), ("gateway", GATEWAY_IMAGE), ("prometheus", PROMETHEUS_IMAGE)):
        build = run(*NICE, ENGINE, "build", "--network=host", "--build-arg", f"BASE={BASE}", "-f", "docker/Dockerfile",
                    *(["--target", target] if target else []), "-t", image, ".", timeout=3600, check=False)
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        figures[f"{target or 'image'}_bytes"] = int(inspect(image, "{{.Size}}"))
    figures["build_s"] = round(time.monotonic() - started, 1)  # both; cached layers where nothing changed

    secrets_ = {"SPECVOX_REDIS_PASSWORD": secrets.token_urlsafe(24), "SPECVOX_SERVICE_TOKEN": secrets.token_urlsafe(24)}
    env_file = tmp_path_factory.mktemp("compose") / "env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in {
        **secrets_, "SPECVOX_IMAGE": IMAGE, "SPECVOX_GATEWAY_IMAGE": GATEWAY_IMAGE,
        "SPECVOX_PROMETHEUS_IMAGE": PROMETHEUS_IMAGE, "SPECVOX_LLM_REPLICAS": 2,
        "SPECVOX_TTS_REPLICAS": 2, "SPECVOX_GATEWAY_PORT": host_port(), "SPECVOX_HTTP_PORT": host_port()}.items()))
    base = [*COMPOSE, "-p", PROJECT, "--env-file", str(env_file), "-f", "docker/compose.yaml"]
    remove_project(base)  # a run killed before its teardown
    started = time.monotonic()
    # the replicas from the env file (compose.yaml's `scale:`): podman-compose takes one --scale only
    up = run(*NICE, *base, "up", "-d", timeout=900, check=False)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        names = {service: containers(service) for service in SERVICES}
        assert {s: len(n) for s, n in names.items()} == SERVICES, names
        waiting = [c for cs in names.values() for c in cs]
        deadline = time.monotonic() + 600
        while waiting:
            assert time.monotonic() < deadline, f"not healthy after 600 s: {waiting}"
            waiting = [c for c in waiting if not healthy(c)]
            time.sleep(2)
        figures["healthy_s"] = round(time.monotonic() - started, 1)
        # Prometheus alone of the monitoring profile (Grafana's image needs a registry), beside the running stack
        monitoring = run(*NICE, *base, "--profile", "monitoring", "up", "-d", "--no-deps", "prometheus", timeout=300,
                         check=False)
        assert monitoring.returncode == 0, monitoring.stdout[-3000:] + monitoring.stderr[-3000:]
        [prometheus] = containers("prometheus")
        port = re.search(r"SPECVOX_GATEWAY_PORT=(\d+)", env_file.read_text())[1]
        yield {"names": names, "prometheus": prometheus, "figures": figures, "gateway": f"127.0.0.1:{port}", **secrets_,
               "redis": f"redis://:{secrets_['SPECVOX_REDIS_PASSWORD']}@{ip_of(names['redis'][0])}:6379/0"}
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        logs = run(*base, "logs", check=False, timeout=120)
        (ARTIFACTS / "containers.log").write_text(logs.stdout + logs.stderr)
        remove_project(base)
        (ARTIFACTS / "containers.json").write_text(json.dumps(figures, indent=2) + "\n")
        print("\n" + "\n".join(f"{k:<12} {v}" for k, v in figures.items()))


def test_every_service_passes_its_health_check_and_a_dead_address_fails_it(compose):
    for names in compose["names"].values():
        for name in names:
            assert healthy(name, tries=3), name
    # The same command against a port nothing listens on must fail: the check can tell.
    gateway = compose["names"]["gateway"][0]
    assert run(ENGINE, "exec", gateway, "specvox", "health", "127.0.0.1:1", check=False).returncode != 0


async def test_valkey_wants_its_password_and_keeps_an_aof(compose):
    import redis.asyncio as aioredis
    from redis.exceptions import AuthenticationError, ResponseError

    stranger = aioredis.from_url(compose["redis"].replace(f":{compose['SPECVOX_REDIS_PASSWORD']}@", "@"))
    with pytest.raises((AuthenticationError, ResponseError)):
        await stranger.ping()
    await stranger.aclose()
    client = connect(compose["redis"])
    try:
        assert (await client.config_get("appendonly"))["appendonly"] == "yes"
    finally:
        await client.aclose()


async def test_the_llm_refuses_a_caller_without_the_service_credential(compose):
    import grpc

    address = f"{ip_of(compose['names']['llm'][0])}:50052"
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await llm_grpc.LlmStub(channel).Capabilities(llm.CapabilitiesRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def talk(compose, speech, text: str, config: dict) -> list:
    options = ClientOptions(chunk_ms=40, wait_for_replies=True, trailing_silence_s=0.5,
                            config=gw.SessionConfig(**config))
    return await asyncio.wait_for(converse_script(compose["gateway"], [Say(float_to_pcm16(speech(text)))], FMT,
                                                  options), 300)


def test_the_gateway_runs_the_slim_image_without_torch(compose):
    gateway = compose["names"]["gateway"][0]
    assert inspect(gateway, "{{.ImageName}}" if ENGINE == "podman" else "{{.Config.Image}}") == GATEWAY_IMAGE
    probe = run(ENGINE, "exec", gateway, "python", "-c", "import importlib.util as u; print(u.find_spec('torch'))")
    assert probe.stdout.strip() == "None"


async def test_a_spoken_turn_through_the_published_gateway(compose, speech):
    turns = await talk(compose, speech, "What is the capital of France?", {"max_reply_tokens": 24, "budget_ms": 60_000})
    [turn] = [t for t in turns if t.report]
    assert "capital" in turn.transcript.lower() and "france" in turn.transcript.lower(), turn.transcript
    assert turn.report["finish_reason"] in ("eos", "length") and turn.reply_text.strip() and turn.audio


async def test_an_llm_container_killed_mid_reply_the_other_replica_finishes_it(compose, speech):
    redis = connect(compose["redis"])
    by_host = {inspect(name, "{{.Config.Hostname}}"): name for name in compose["names"]["llm"]}
    try:
        async def kill_the_holder() -> dict:
            """Freeze the holding container (its process, seen from here), wait for three steps, SIGKILL it."""
            while not (pending := await redis.xpending_range(work_key("llm"), "llm", "-", "+", 10)):
                await asyncio.sleep(0.02)
            consumer = pending[0]["consumer"]  # llm-<container hostname>-<pid>
            [(_, fields)] = await redis.xrange(work_key("llm"), pending[0]["message_id"], pending[0]["message_id"])
            container = next(name for hostname, name in by_host.items() if consumer.startswith(f"llm-{hostname}-"))
            pid = int(inspect(container, "{{.State.Pid}}"))
            while True:
                os.kill(pid, signal.SIGSTOP)
                entries = await read_token_log(redis, fields["turn"])
                assert not (entries and entries[-1].end), "the reply ended before the kill"
                if len(entries) >= 3:  # a crash, as the OOM killer makes one (`podman kill` would be a stop)
                    os.kill(pid, signal.SIGKILL)
                    return {"container": container, "turn": fields["turn"]}
                os.kill(pid, signal.SIGCONT)
                await asyncio.sleep(0.01)

        killer = asyncio.create_task(kill_the_holder())
        turns = await talk(compose, speech, STORY, CONFIG)
        killed = await killer
        compose["killed"] = killed["container"]
        turn = next(t for t in turns if t.turn_id == killed["turn"])
        assert turn.report["finish_reason"] in ("eos", "length"), turn.report
        entries = await read_token_log(redis, killed["turn"])
        assert [e.seq for e in entries] == list(range(len(entries))) and entries[-1].end  # each step once
        assert int(await redis.hget(turn_key(killed["turn"]), "llm_epoch")) >= 2  # the other replica took it
        survivor = next(name for name in compose["names"]["llm"] if name != killed["container"])
        tokens = [t for e in entries for t in e.token_ids]
        survivor_address = f"{ip_of(survivor)}:50052"
        assert tokens == await uninterrupted_reply(compose, survivor_address, redis, turn.report["transcript"])
        assert turn.reply_text == "".join(e.text for e in entries)  # the client got every delta once
    finally:
        await redis.aclose()


def test_the_crashed_llm_container_is_restarted_and_healthy_again(compose):
    """`restart: unless-stopped`: the engine starts the crashed replica again; it loads and serves."""
    name = compose.get("killed")
    assert name, "runs after the kill test"
    deadline = time.monotonic() + 600
    while not (int(inspect(name, "{{.RestartCount}}") or 0) >= 1 and inspect(name, "{{.State.Status}}") == "running"
               and healthy(name)):
        assert time.monotonic() < deadline, f"{name} not back: {inspect(name, '{{.State.Status}}')}"
        time.sleep(2)


def test_the_voice_to_voice_histogram_is_scraped_from_the_gateway(compose):
    """The gateway's /metrics holds the turns' voice-to-voice histogram, and every replica serves its own."""
    def scrape(container: str, port: int) -> str:
        return urllib.request.urlopen(f"http://{ip_of(container)}:{port}/metrics", timeout=10).read().decode()

    gateway = scrape(compose["names"]["gateway"][0], 9100)
    count = re.search(r"^specvox_voice_to_voice_seconds_count(?:\{[^}]*\})? (\S+)$", gateway, re.M)
    assert count and float(count[1]) >= 1, gateway[:2000]
    assert re.search(r'^specvox_voice_to_voice_seconds_bucket\{[^}]*le="\+Inf"[^}]*\} ', gateway, re.M)
    for service, port in (("asr", 9101), ("llm", 9102), ("tts", 9103)):
        for name in compose["names"][service]:
            assert "specvox_" in scrape(name, port), name
    compose["figures"]["voice_to_voice_turns"] = float(count[1])


def test_prometheus_scrapes_every_replica_and_holds_the_turns_voice_to_voice_histogram(compose):
    """The monitoring profile's Prometheus (docker/prometheus.yml: every replica found by DNS) up and scraping
    all seven targets, and its query API answering with the voice-to-voice turns the tests above made."""
    api = f"http://{ip_of(compose['prometheus'])}:9090/api/v1"

    def get(path: str) -> dict:
        return json.loads(urllib.request.urlopen(f"{api}/{path}", timeout=10).read())["data"]

    deadline, expected = time.monotonic() + 120, {"gateway": 1, "asr": 1, "llm": 2, "tts": 2}
    while True:
        try:
            targets = get("targets?state=active")["activeTargets"]
            up = {job: sum(t["labels"]["job"] == job and t["health"] == "up" for t in targets) for job in expected}
            result = get("query?query=" + urllib.parse.quote("sum(specvox_voice_to_voice_seconds_count)"))["result"]
            turns = float(result[0]["value"][1]) if result else 0.0
        except OSError:  # not listening yet
            up, turns = {}, 0.0
        if up == expected and turns >= 1:
            break
        assert time.monotonic() < deadline, f"after 120 s: targets up {up}, voice-to-voice turns {turns}"
        time.sleep(3)
    buckets = get("query?query=" + urllib.parse.quote("specvox_voice_to_voice_seconds_bucket"))["result"]
    assert any(b["metric"].get("le") == "+Inf" for b in buckets)
    compose["figures"]["prometheus_turns"] = turns


async def uninterrupted_reply(compose, address: str, redis, user_text: str) -> list[int]:
    """The same turn decoded by the surviving replica's standalone Reply call, in a new session."""
    from services.channels import open_channel
    from services.store.sessions import SessionStore
    from services.store.turn_log import TurnStore

    session = await SessionStore(redis).create("")
    turn = await TurnStore(redis).create(session)
    async with open_channel(address, secret=compose["SPECVOX_SERVICE_TOKEN"]) as channel:
        steps = [s async for s in llm_grpc.LlmStub(channel).Reply(llm.ReplyRequest(
            session_id=session, turn_id=turn, user_text=user_text, max_new_tokens=CONFIG["max_reply_tokens"],
            defer_history=True))]
    assert steps[-1].end and steps[-1].finish_reason in ("eos", "length")
    return [t for s in steps for t in s.token_ids]


def test_the_prometheus_config_scrapes_every_service_by_name():
    import yaml

    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in config["scrape_configs"]}
    compose_file = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    for service in ("gateway", "asr", "llm", "tts"):
        port = int(compose_file["services"][service]["environment"]["SPECVOX_METRICS_PORT"])
        assert jobs[service]["names"] == [service] and jobs[service]["port"] == port


