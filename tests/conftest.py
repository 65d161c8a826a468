"""Shared fixtures: a real Valkey, the real four-service stack, the bundled voice for test speech."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.audio import float_to_pcm16, wav_bytes
from services.redis_store import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
STACK_START_TIMEOUT_S = 300


# Under `pytest -n N` (the Makefile runs two workers) each worker computes on one thread:
# N workers each spinning torch's or onnxruntime's full pool on the same cores slow the
# model-heavy tests threefold. The services the tests start keep their own settings.
PARALLEL_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
IN_PROCESS_THREADS = 1 if PARALLEL_WORKERS > 1 else 0  # 0: the libraries' own default


def pytest_configure(config) -> None:
    if IN_PROCESS_THREADS:
        import torch

        torch.set_num_threads(IN_PROCESS_THREADS)


# The ports tests listen on come from a block of each xdist worker's own, below the kernel's
# ephemeral range (32768-60999 by default). A port the kernel hands out (a server bound to port 0,
# an outgoing connection, another worker's free port) can never be one of them, and the ports
# `specvox up` derives (worker i of a stage at its port + i * 100) lie inside what was reserved.
# A port found taken (another run alongside) is skipped.
PORTS_FIRST, PORTS_END = 20_000, 32_768
_WORKER_INDEX = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_PORTS_PER_WORKER = (PORTS_END - PORTS_FIRST) // PARALLEL_WORKERS
_WORKER_PORTS_FIRST = PORTS_FIRST + _WORKER_INDEX * _PORTS_PER_WORKER
_WORKER_PORTS = range(_WORKER_PORTS_FIRST, _WORKER_PORTS_FIRST + _PORTS_PER_WORKER)
_next_port = _WORKER_PORTS.start
STACK_PORT_SPAN = 400  # `specvox up`: 4 stages x up to 4 workers at the supervisor's stride of 100


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(span: int) -> int:
    """The first of `span` consecutive ports, all free, none handed out before in this run."""
    global _next_port
    while _next_port + span <= _WORKER_PORTS.stop:
        first, _next_port = _next_port, _next_port + span
        if all(_bindable(port) for port in range(first, first + span)):
            return first
    raise RuntimeError(f"this test worker's ports ({_WORKER_PORTS.start}-{_WORKER_PORTS.stop - 1}) are used up")


def free_port() -> int:
    return free_ports(1)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Valkey of the test module's own. Stacks that share a Redis share its work queues (that
    is how workers scale out), so a stack left running by another module would take this
    module's turns: each module's workers, and what its tests read back, stay on their own."""
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def synthesizer():
    from pipeline.tts.piper_backend import PiperSynthesizer, TtsOptions

    return PiperSynthesizer(TtsOptions(noise_scale=0.0, noise_w_scale=0.0,  # the same speech every run
                                       threads=IN_PROCESS_THREADS))


@pytest.fixture(scope="session")
def speech(synthesizer):
    """speech(text, rate) -> mono float32 with 0.4 s of silence either side."""

    def make(text: str, sample_rate_hz: int = 16_000) -> np.ndarray:
        pad = np.zeros(int(0.4 * sample_rate_hz), np.float32)
        return np.concatenate([pad, synthesizer.synthesize(text, sample_rate_hz), pad])

    return make


@contextlib.contextmanager
def specvox_up(redis_url: str, log_dir: Path, env: dict[str, str] | None = None,
               args: tuple[str, ...] = ()) -> Iterator[dict[str, str]]:
    """`specvox up` as a user runs it, on free ports, sharing the test's Valkey; Ctrl-C at the end."""
    first = free_ports(STACK_PORT_SPAN)
    ports = {name: first + i for i, name in enumerate(("gateway", "asr", "llm", "tts"))}
    environ = dict(os.environ, SPECVOX_REDIS_URL=redis_url, SPECVOX_LOG_LEVEL="WARNING", **(env or {}))
    environ.update({f"SPECVOX_{name.upper()}_PORT": str(port) for name, port in ports.items()})
    log = log_dir / "up.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *args], cwd=ROOT, env=environ,
                                   stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STACK_START_TIMEOUT_S
    while b"all services ready" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"specvox up {' '.join(args)} did not become ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    yield {name: f"127.0.0.1:{port}" for name, port in ports.items()} | {"redis": redis_url}
    process.send_signal(2)  # Ctrl-C
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("specvox up did not stop within 30 s of Ctrl-C")
    assert process.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The four services, started by `specvox up` on a Valkey of their own (see redis_url)."""
    with EmbeddedRedis() as server, specvox_up(server.url, tmp_path_factory.mktemp("stack")) as addresses:
        yield addresses


@pytest.fixture(scope="session")
def tiny_llm_dir(tmp_path_factory):
    """A small random Llama beside the bundled tokenizer: a 'model the user names by path',
    and a true float64 target for exactness tests (the GGUF target computes in float32)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.models import resolve_llm

    bundled = resolve_llm("bundled")
    tokenizer = AutoTokenizer.from_pretrained(bundled.name_or_path, gguf_file=bundled.gguf_file)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_wav(path: Path, samples: np.ndarray, sample_rate_hz: int, channels: int = 1) -> Path:
    if channels == 2:
        samples = np.repeat(samples, 2)
    path.write_bytes(wav_bytes(float_to_pcm16(samples), sample_rate_hz, channels))
    return path


@pytest.fixture(scope="session")
def espeak():
    """espeak(text, rate) -> mono float32 speech by espeak-ng (a voice whisper finds harder).

    Missing espeak-ng skips locally; in CI (CI=true) it fails: .ci/run installs it.
    """
    import shutil

    from pipeline.audio import pcm_to_mono_float, resample, split_wav_bytes

    if shutil.which("espeak-ng") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("espeak-ng is not on PATH; CI must install it (apt-get install espeak-ng)")
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")

    def make(text: str, sample_rate_hz: int = 16_000) -> np.ndarray:
        wav = subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "--stdout", text],
                             check=True, capture_output=True).stdout
        pcm, fmt = split_wav_bytes(wav)
        samples = resample(pcm_to_mono_float(pcm, fmt), fmt.sample_rate_hz, sample_rate_hz)
        pad = np.zeros(int(0.4 * sample_rate_hz), np.float32)
        return np.concatenate([pad, samples, pad])

    return make


@dataclass
class LlmOnLoopback:
    """The llm servicer on a gRPC server of its own, with its Redis and a stub that reaches it."""

    stub: Any
    servicer: Any
    redis: Any
    settings: Any

    @property
    def loaded(self):
        return self.servicer.loaded


@contextlib.asynccontextmanager
async def llm_on_loopback(redis_url: str, options) -> AsyncIterator[LlmOnLoopback]:
    """`options` (LlmOptions) served by `LlmServicer` on a free loopback port, stopped at the end."""
    import grpc

    from pipeline.llm.model import load_model
    from services.protos import load
    from services.runtime import open_redis
    from services.settings import Settings
    from services.stages.llm import LlmServicer

    _, llm_grpc = load("llm")
    settings = Settings(redis_url=redis_url, llm=options)
    redis = await open_redis(settings)
    servicer = LlmServicer(settings, load_model(options), redis)
    server = grpc.aio.server()
    llm_grpc.add_LlmServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield LlmOnLoopback(llm_grpc.LlmStub(channel), servicer, redis, settings)
    finally:
        await server.stop(None)
        await redis.close()
