"""Shared fixtures: a real Valkey, the real four-service stack, the bundled voice for test speech."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.audio import float_to_pcm16, wav_bytes
from services.stack import STOP_TIMEOUT_S, StackDidNotStart, running_stack, use_port_block
from services.store.embedded import EmbeddedRedis

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
use_port_block(_WORKER_PORTS)  # services.stack.free_port(s), here and in EmbeddedRedis


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Valkey of the test module's own. Stacks that share a Redis share its work queues (that
    is how workers scale out), so a stack left running by another module would take this
    module's turns: each module's workers, and what its tests read back, stay on their own."""
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def transcriber():
    """The bundled whisper model, as the asr service loads it by default."""
    from pipeline.asr import AsrOptions, Transcriber

    return Transcriber(AsrOptions())


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
    """`specvox up` as a user runs it (services/stack.py), on free ports, sharing the test's Valkey;
    Ctrl-C at the end, which it must obey with exit code 0."""
    try:
        with running_stack(log_dir, args=args, env={"SPECVOX_LOG_LEVEL": "WARNING", **(env or {})}, redis=redis_url,
                           cwd=ROOT, start_timeout_s=STACK_START_TIMEOUT_S) as stack:
            yield stack.addresses | {"redis": redis_url, "http": stack.http}
    except StackDidNotStart as e:
        pytest.fail(str(e))
    if stack.killed:
        pytest.fail(f"specvox up did not stop within {STOP_TIMEOUT_S:.0f} s of Ctrl-C")
    assert stack.returncode == 0, stack.log.read_text()[-3000:]


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The four services, started by `specvox up` on a Valkey of their own (see redis_url); "http": the
    gateway's HTTP surface."""
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


def with_a_perturbed_draft(target_options, draft_options=None):
    """A Generator on `target_options`' model whose draft model is the same weights (loaded by
    `draft_options`, the target's by default) perturbed, seeded: a drafter often right, not always."""
    import torch

    from pipeline.llm.engine import Generator
    from pipeline.llm.model import load_model

    target = load_model(target_options)
    torch.manual_seed(1)
    draft = load_model(draft_options or target_options)
    with torch.no_grad():
        for parameter in draft.model.parameters():
            parameter.add_(0.005 * torch.randn_like(parameter))
    return Generator(target, draft, early_exit_layers=2)


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
    from services.settings import Settings
    from services.stages.llm import LlmServicer
    from services.store.context import open_redis

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
