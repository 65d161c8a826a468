"""Supervision and draining with real processes: `specvox up` restarting a SIGKILLed tts worker
while its sibling keeps serving, giving up on a crash loop, `--workers` parsing, and a tts
service draining on SIGTERM (an in-flight stream finishes, a new call is refused, a background
worker sees the drain). tts is the cheapest service that is a stage with workers.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.protos import load
from services.server.memory_trace import frames_for
from services.server.supervisor import SupervisorOptions, describe_exit, parse_workers, restart_delay_s
from services.stack import free_port
from tests.conftest import ROOT, specvox_up

tts, tts_grpc = load("tts")
START_TIMEOUT_S = 180  # a tts process loading its voice on a busy 2-core machine
FAST_RESTARTS = {"SPECVOX_SUPERVISOR__RESTART_BACKOFF_S": "0.1", "SPECVOX_DRAIN_GRACE_S": "20"}


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_for(log: Path, pattern: str, process: subprocess.Popen | None = None) -> re.Match:
    deadline = time.monotonic() + START_TIMEOUT_S
    while (found := re.search(pattern, log.read_text())) is None:
        if time.monotonic() > deadline or (process is not None and process.poll() is not None):
            pytest.fail(f"{pattern!r} not in the log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --workers, and the restart policy, as functions


def test_workers_parse_stage_counts():
    assert parse_workers("llm=2,tts=2") == {"llm": 2, "tts": 2}
    assert parse_workers(" llm = 3 , ") == {"llm": 3}
    assert parse_workers("gateway=1,asr=2") == {"gateway": 1, "asr": 2}


@pytest.mark.parametrize(("text", "says"), [
    ("foo=2", "'foo' is not a stage here; the stages are asr, llm, tts, gateway"),
    ("llm=0", "llm=0: the count must be between 1 and 64"),
    ("llm=-1", "llm=-1: the count must be between 1 and 64"),
    ("llm=65", "between 1 and 64"),
    ("llm=two", "llm='two': the count must be a whole number"),
    ("llm", "'llm': expected STAGE=COUNT"),
    ("llm=2,llm=3", "llm is given twice"),
    ("", "no STAGE=COUNT given"),
])
def test_bad_workers_are_refused_with_the_reason(text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_workers(text)


@pytest.mark.parametrize(("args", "says"), [
    (["--workers", "llm=zero"], "argument --workers: llm='zero': the count must be a whole number"),
    (["--workers", "tss=2"], "argument --workers: 'tss' is not a stage here"),
    (["--services", "tts,ocr"], "argument --services: ocr: the stages are asr, llm, tts, gateway"),
])
def test_specvox_up_refuses_bad_flags_before_starting_anything(args, says):
    done = subprocess.run([sys.executable, "-m", "services.cli", "up", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert says in done.stderr
    assert "started" not in done.stdout


def test_restart_backoff_doubles_per_exit_in_the_window_up_to_its_cap():
    options = SupervisorOptions(restart_backoff_s=0.5, restart_backoff_max_s=3.0)
    assert [restart_delay_s(n, options) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"


# `specvox up` supervising real tts workers


def test_a_killed_worker_is_restarted_while_its_sibling_keeps_serving(redis_url, tmp_path):
    with specvox_up(redis_url, tmp_path, env=FAST_RESTARTS, args=("--services", "tts", "--workers", "tts=2")):
        log = tmp_path / "up.log"
        rows = re.findall(r"^\s+(tts-\d)\s+(\S+)\s+pid (\d+)", log.read_text(), re.M)  # the ready table
        addresses = {name: address for name, address, _ in rows}
        pids = {name: int(pid) for name, _, pid in rows}
        assert set(pids) == {"tts-0", "tts-1"} and addresses["tts-0"] != addresses["tts-1"]

        os.kill(pids["tts-0"], signal.SIGKILL)
        wait_for(log, rf"tts-0 \(pid {pids['tts-0']}\) killed by SIGKILL; restarting it in 0\.1 s")
        assert serving(addresses["tts-1"]), "tts-1 stopped serving while tts-0 was down"
        again = wait_for(log, r"tts-0 ready again \(pid (\d+)\)")

        new_pid = int(again.group(1))
        assert new_pid != pids["tts-0"] and alive(new_pid) and not alive(pids["tts-0"])
        assert serving(addresses["tts-0"]) and serving(addresses["tts-1"])
        assert alive(pids["tts-1"]) and "restarted tts-1" not in log.read_text()  # the same process throughout
        assert len(re.findall(r"specvox tts \(tts-0\) listening on " + re.escape(addresses["tts-0"]),
                              log.read_text())) == 2  # the same name and address after its restart
    # specvox_up's exit: Ctrl-C drained both and `specvox up` exited 0
    assert not alive(new_pid) and not alive(pids["tts-1"])


def test_a_crash_looping_worker_makes_up_give_up_and_stop_the_stack(redis_url, tmp_path):
    port = free_port()
    env = dict(os.environ, SPECVOX_REDIS_URL=redis_url, SPECVOX_LOG_LEVEL="WARNING", SPECVOX_TTS_PORT=str(port),
               SPECVOX_SUPERVISOR__MAX_RESTARTS="1", **FAST_RESTARTS)
    log = tmp_path / "up.log"
    with socket.socket() as taken:  # tts-0's port is another program's: every start of tts-0 fails to listen
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with open(log, "wb") as out:
            up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--services", "tts", "--workers",
                                   "tts=2"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            up.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            up.kill()
            pytest.fail(f"specvox up did not give up:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert up.returncode == 1, text[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}" in text
    assert re.search(r"tts-0 \(pid \d+\) exited with code 1; restarting it in 0\.1 s", text), text[-3000:]
    gave_up = (r"tts-0 \(pid \d+\) exited with code 1; it exited 2 times within 60 s "
               r"\(supervisor\.max_restarts=1\): crash loop, giving up and stopping the stack")
    assert re.search(gave_up, text), text[-3000:]
    sibling = int(re.search(r"started tts-1 \(pid (\d+)\)", text).group(1))
    assert not alive(sibling), "the rest of the stack was left running"
    assert "all services ready" not in text


# run_service draining a real tts service


def start_probe(redis_url: str, log: Path, mode: str, **more_env: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, SPECVOX_REDIS_URL=redis_url, SPECVOX_TTS_PORT=str(port), SPECVOX_DRAIN_GRACE_S="30",
               SPECVOX_PROBE=mode, SPECVOX_WORKER_NAME="tts-probe", **more_env)
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tests.service_probe"], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    return process, f"127.0.0.1:{port}"


async def test_sigterm_drains_an_in_flight_stream_refuses_new_calls_and_tells_the_workers(redis_url, tmp_path):
    log = tmp_path / "tts.log"
    process, address = start_probe(redis_url, log, "drain")
    try:
        wait_for(log, r"specvox tts \(tts-probe\) listening", process)
        async with grpc.aio.insecure_channel(address) as channel:
            pieces: asyncio.Queue = asyncio.Queue()

            async def text():
                while (piece := await pieces.get()) is not None:
                    yield piece

            call = tts_grpc.TtsStub(channel).SynthesizeStream(text())
            await pieces.put(tts.TextPiece(text="Hello there, this is the first phrase. "))
            first = await call.read()
            assert first.WhichOneof("event") in ("word", "viseme", "audio")

            process.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(channel)
            while True:  # NOT_SERVING, then no answer at all once the server takes no new call
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert reply.status in (health_pb2.HealthCheckResponse.SERVING,
                                            health_pb2.HealthCheckResponse.NOT_SERVING)
                except grpc.RpcError as e:  # a check that arrives as the server stops taking calls is cancelled
                    assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
                    break
                await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(address) as fresh:
                with pytest.raises(grpc.RpcError) as refused:
                    async for _ in tts_grpc.TtsStub(fresh).Synthesize(tts.SynthesizeRequest(text="A new call.")):
                        pass
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            # the call in flight goes on: a phrase sent after the drain began is spoken, the stream ends OK
            await pieces.put(tts.TextPiece(text="And this second phrase comes after the drain began."))
            await pieces.put(None)
            events = [first]
            while (event := await call.read()) is not grpc.aio.EOF:
                events.append(event)
            assert await call.code() == grpc.StatusCode.OK
        spoken = " ".join(e.cue.text for e in events if e.WhichOneof("event") == "cue")
        assert "first phrase" in spoken and "after the drain began" in spoken, spoken
        assert sum(e.WhichOneof("event") == "audio" for e in events) > 1
        assert events[-1].WhichOneof("event") == "times"
        assert process.wait(60) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "tts-probe: SIGTERM: draining" in text and "probe: drain seen" in text
        assert text.index("tts-probe: SIGTERM: draining") < text.index("probe: drain seen")
    finally:
        if process.poll() is None:
            process.kill()


def test_a_failing_background_worker_takes_the_service_down_with_the_reason(redis_url, tmp_path):
    log = tmp_path / "tts.log"
    process, _ = start_probe(redis_url, log, "fail")
    try:
        assert process.wait(START_TIMEOUT_S) == 1, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "tts-probe: background worker probe failed: RuntimeError: the probe worker failed on purpose; " \
           "stopping the service (its supervisor restarts it)" in text, text[-3000:]
    assert "Traceback" in text  # the worker's own traceback, logged where it failed


def test_tracemalloc_spec_names_services_and_their_frames():
    assert frames_for("gateway", "gateway") == 10 and frames_for("gateway", "tts, gateway:25") == 25
    assert frames_for("llm", "gateway:25,tts") == 0 and frames_for("tts", "") == 0
    with pytest.raises(ValueError, match="'tts:many' is not service\\[:frames\\]"):
        frames_for("tts", "gateway,tts:many")


def test_sigusr2_writes_a_tracemalloc_snapshot_of_a_traced_service_and_it_keeps_serving(redis_url, tmp_path):
    log = tmp_path / "tts.log"
    snapshots = tmp_path / "snapshots"
    process, address = start_probe(redis_url, log, "drain",
                                   SPECVOX_TRACEMALLOC="gateway,tts:6", SPECVOX_TRACEMALLOC_DIR=str(snapshots))
    try:
        wait_for(log, r"specvox tts \(tts-probe\) listening", process)
        assert "tts-probe: tracing Python allocations (6 frames)" in log.read_text()
        process.send_signal(signal.SIGUSR2)
        found = wait_for(log, r"tracemalloc snapshot (\S+) \(([\d.]+) MB traced", process)
        path = Path(found.group(1))
        assert path.parent == snapshots and path.name.startswith(f"tts-probe-{process.pid}-")
        snapshot = tracemalloc.Snapshot.load(str(path))
        assert snapshot.traceback_limit == 6 and snapshot.traces
        # what the service allocated after the start of tracing: its own code among the tracebacks
        files = {frame.filename for trace in snapshot.traces for frame in trace.traceback}
        assert any(f.endswith("services/stages/tts.py") or "/services/server/" in f for f in files)
        assert serving(address) and process.poll() is None  # a snapshot stops nothing
    finally:
        process.send_signal(signal.SIGTERM)
        if process.wait(60) != 0:
            pytest.fail(log.read_text()[-3000:])


def test_a_service_process_takes_its_nice_value_on_every_thread():
    """Linux keeps a nice value per thread: a thread started before `set_priority` is lowered too,
    and one started after inherits it; a service with no value keeps 0."""
    script = """
import os, threading, types
from services.server.runtime import set_priority
start = os.getpriority(os.PRIO_PROCESS, 0)
before = threading.Thread(target=threading.Event().wait, daemon=True)
before.start()
settings = types.SimpleNamespace(nice={"llm": 7})
set_priority(settings, "asr")
untouched = os.getpriority(os.PRIO_PROCESS, 0)
set_priority(settings, "llm")
after = threading.Thread(target=threading.Event().wait, daemon=True)
after.start()
print(untouched == start, sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split(maxsplit=1)
    assert out == ["True", "[7]\n"]


_SIGTERM_INSIDE_THE_STACK_BLOCK = """
import os, signal
from services.stack import _terminate_as_interrupt
try:
    with _terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # not reached: the signal raises at once
except KeyboardInterrupt as e:
    print("interrupted:", e)
print("handler restored:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
"""


def test_sigterm_to_a_benchmark_ends_its_stack_block_as_ctrl_c_does():
    """A benchmark or the demo killed by SIGTERM runs the `finally` that stops its `specvox up`
    (services.stack.running_stack), instead of dying and leaving the stack running."""
    run = subprocess.run([sys.executable, "-c", _SIGTERM_INSIDE_THE_STACK_BLOCK], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["interrupted: signal SIGTERM", "handler restored: True"]
