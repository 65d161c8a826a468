"""The Coqui TTS backend for real, in its own environment (.venv-coqui, `make coqui`).

coqui-tts cannot be imported beside the project's torch, so these tests drive the Coqui
env's python: it builds tiny random-weight models (a VITS, an XTTS;
tests/coqui_tiny_models.py), runs the backend on them (tests/coqui_probe.py), and runs the
tts gRPC service with the VITS under `specvox up --tts-python`. The models speak noise, so
the tests check the audio's form, rate, pieces and errors, not its words.

Without .venv-coqui these tests skip locally; in CI (CI=true) they fail, as `make test`
builds it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline.models import ModelNotFoundError
from pipeline.tts.backend import TtsOptions
from pipeline.tts.synthesizers import load_synthesizer
from services.protos import load
from tests.conftest import ROOT, specvox_up, write_wav
from tests.grpc_status import expect_status

tts, tts_grpc = load("tts")
TINY_RATE_HZ = 16_000  # the tiny VITS (tests/coqui_tiny_models.py); Piper's bundled voice speaks at 22,050
TEXT = "Hello there. How are you today, my friend?"


COQUI_BUILD_WAIT_S = 1200  # the env's build, started by `make test` beside the tests, is a few minutes


def wait_for_the_coqui_build() -> None:
    """`make test` builds the Coqui env in the background and names the file its exit status
    goes to (SPECVOX_COQUI_BUILD_STATUS): wait for it, and fail on a failed build with its log."""
    status_file = os.environ.get("SPECVOX_COQUI_BUILD_STATUS")
    if not status_file:
        return
    status = Path(status_file)
    deadline = time.monotonic() + COQUI_BUILD_WAIT_S
    while not status.is_file():
        if time.monotonic() > deadline:
            pytest.fail(f"the Coqui env's build did not end within {COQUI_BUILD_WAIT_S} s (no {status})")
        time.sleep(2)
    code = status.read_text().strip()
    if code != "0":
        log = status.with_suffix(".log")
        tail = log.read_text()[-3000:] if log.is_file() else "(no log)"
        pytest.fail(f"building the Coqui env failed (exit {code}); {log}:\n{tail}")


@pytest.fixture(scope="session")
def coqui_python() -> str:
    wait_for_the_coqui_build()
    python = os.environ.get("SPECVOX_COQUI_PYTHON") or str(ROOT / ".venv-coqui" / "bin" / "python")
    if not Path(python).is_file():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{python} is missing; CI must build the Coqui env (make coqui, run by make test)")
        pytest.skip(f"no Coqui env at {python} (run `make coqui`)")
    return python


def coqui_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


def build_tiny_model(coqui_python: str, kind: str, folder: Path, *names: str) -> None:
    done = subprocess.run([coqui_python, str(ROOT / "tests" / "coqui_tiny_models.py"), kind, str(folder), *names],
                          cwd=ROOT, env=coqui_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="session")
def tiny_vits(coqui_python, tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("tiny-vits")
    build_tiny_model(coqui_python, "vits", folder)
    return str(folder / "model.pth"), str(folder / "config.json")


def tiny_options(tiny_vits, **overrides) -> dict:
    checkpoint, config = tiny_vits
    return {"backend": "coqui", "coqui_model": checkpoint, "coqui_config": config,
            "noise_scale": 0.0, "noise_w_scale": 0.0} | overrides


def probe_load(coqui_python: str, options: list[dict], **env: str) -> list[dict]:
    done = subprocess.run([coqui_python, str(ROOT / "tests" / "coqui_probe.py"), "load", json.dumps(options)],
                          cwd=ROOT, env=coqui_env(**env), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_synth(coqui_python: str, options: dict, out: Path) -> dict:
    done = subprocess.run([coqui_python, str(ROOT / "tests" / "coqui_probe.py"), "synth", str(out),
                           json.dumps(options), TEXT, "22050"],
                          cwd=ROOT, env=coqui_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


@pytest.fixture(scope="session")
def synthesized(coqui_python, tiny_vits, tmp_path_factory):
    return probe_synth(coqui_python, tiny_options(tiny_vits), tmp_path_factory.mktemp("coqui-probe") / "out.npz")


def test_the_backend_synthesizes_audio_at_the_models_rate(synthesized):
    audio = synthesized["audio"]
    assert str(synthesized["name"]) == "coqui"
    assert int(synthesized["sample_rate_hz"]) == TINY_RATE_HZ
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert audio.size / TINY_RATE_HZ > 0.5, "two sentences gave under half a second of audio"
    assert np.sqrt(np.mean(audio**2)) > 1e-3, "the audio is silent"
    assert np.all(np.isfinite(audio)) and np.abs(audio).max() <= 1.0


def test_stream_pieces_are_the_whole_audio_in_order(synthesized):
    assert len(synthesized["piece_sizes"]) == 2, "one piece per sentence"
    assert all(synthesized["piece_sizes"] > 0)
    assert set(synthesized["piece_rates"]) == {TINY_RATE_HZ}
    assert not synthesized["piece_words"].any(), "VITS pieces carry no word timings"
    assert not synthesized["streams"]
    np.testing.assert_array_equal(synthesized["pieces"], synthesized["audio"])


def test_a_requested_rate_resamples(synthesized):
    resampled, audio = synthesized["resampled"], synthesized["audio"]
    assert resampled.dtype == np.float32
    assert abs(resampled.size - audio.size * 22_050 / TINY_RATE_HZ) <= 2


def test_a_model_by_name_loads_from_the_local_coqui_folder_only(coqui_python, tiny_vits, tmp_path):
    """The tiny model placed where Coqui unpacks tts_models/en/ljspeech/vits loads by that name;
    names not on this machine fail with how to fetch them, and nothing is downloaded."""
    home = tmp_path / "tts-home"
    folder = home / "tts" / "tts_models--en--ljspeech--vits"
    folder.mkdir(parents=True)
    shutil.copy(tiny_vits[0], folder / "model_file.pth")
    shutil.copy(tiny_vits[1], folder / "config.json")
    names = ["tts_models/en/ljspeech/vits", "tts_models/en/vctk/vits", "tts_models/multilingual/multi-dataset/xtts_v2",
             "tts_models/xx/nowhere/vits", "tts_models/en/ljspeech/tacotron2-DDC"]
    loaded, vctk, xtts, unknown, needs_vocoder = probe_load(
        coqui_python, [{"backend": "coqui", "coqui_model": name} for name in names],
        TTS_HOME=str(home), HF_HOME=str(tmp_path / "hf-home"))
    assert (loaded["name"], loaded["sample_rate_hz"]) == ("coqui", TINY_RATE_HZ) and loaded["samples"] > 0
    for missing in (vctk, xtts):
        assert missing["error"] == "ModelNotFoundError", missing
        assert "downloads are off" in missing["message"] and "--model_name" in missing["message"], missing
    assert "Hugging Face cache" in xtts["message"]
    assert unknown["error"] == "ModelNotFoundError" and "unknown Coqui model name" in unknown["message"]
    assert needs_vocoder["error"] == "ModelNotFoundError" and "vocoder" in needs_vocoder["message"]
    assert sorted(p.name for p in home.joinpath("tts").iterdir()) == ["tts_models--en--ljspeech--vits"]
    assert not (tmp_path / "hf-home").exists() or not any((tmp_path / "hf-home").rglob("*.pth"))


def test_bad_paths_and_options_give_clear_errors(coqui_python, tiny_vits, tmp_path):
    checkpoint, config = tiny_vits
    cases = [
        tiny_options(tiny_vits, coqui_model=str(tmp_path / "no-such.pth")),
        tiny_options(tiny_vits, coqui_config=str(tmp_path / "no-such.json")),
        tiny_options(tiny_vits, coqui_model=""),
        tiny_options(tiny_vits, coqui_speaker="p225"),
        tiny_options(tiny_vits, coqui_language="fr"),
    ]
    no_checkpoint, no_config, empty, speaker, language = probe_load(coqui_python, cases)
    assert no_checkpoint == {"error": "ModelNotFoundError",
                             "message": f"Coqui checkpoint not found: {tmp_path / 'no-such.pth'}"}
    assert no_config["error"] == "ModelNotFoundError" and str(tmp_path / "no-such.json") in no_config["message"]
    assert empty["error"] == "ModelNotFoundError" and "coqui_model is empty" in empty["message"]
    assert speaker["error"] == "ValueError" and "one speaker" in speaker["message"]
    assert language["error"] == "ValueError" and "not multilingual" in language["message"]


@pytest.fixture(scope="session")
def tiny_multi_vits(coqui_python, tmp_path_factory) -> tuple[str, str]:
    """The tiny VITS with two speakers and two languages (speaker and language embeddings)."""
    folder = tmp_path_factory.mktemp("tiny-multi-vits")
    build_tiny_model(coqui_python, "vits", folder, "alice,bob", "en,fr")
    return str(folder / "model.pth"), str(folder / "config.json")


def test_speaker_and_language_choose_the_voice(coqui_python, tiny_multi_vits):
    voices = [("alice", "en"), ("bob", "en"), ("alice", "fr"), ("alice", "en"),
              ("", "en"), ("carol", "en"), ("alice", ""), ("alice", "de")]
    results = probe_load(coqui_python, [tiny_options(tiny_multi_vits, coqui_speaker=speaker, coqui_language=language)
                                        for speaker, language in voices])
    alice_en, bob_en, alice_fr, alice_en_again = results[:4]
    assert all("sha1" in r for r in results[:4]), results[:4]
    assert alice_en["sha1"] == alice_en_again["sha1"], "with zero noise the same voice speaks the same audio"
    assert len({alice_en["sha1"], bob_en["sha1"], alice_fr["sha1"]}) == 3, "speaker and language change nothing"
    no_speaker, unknown_speaker, no_language, unknown_language = results[4:]
    assert no_speaker == {"error": "ValueError", "message": "this Coqui model has several voices: "
                                                            "set tts.coqui_speaker to one of alice, bob"}
    assert unknown_speaker["error"] == "ValueError" and "unknown Coqui speaker 'carol'" in unknown_speaker["message"]
    assert no_language == {"error": "ValueError", "message": "this Coqui model is multilingual: "
                                                             "set tts.coqui_language to one of en, fr"}
    assert unknown_language == {"error": "ValueError", "message": "unknown Coqui language 'de': choose one of en, fr"}


def test_xtts_streams_pieces_in_a_voice_cloned_from_a_recording(coqui_python, speech, tmp_path):
    """A tiny XTTS, its voice from a 16-bit WAV (read without torchaudio/FFmpeg): the phrase comes
    in several pieces as the GPT decodes, at XTTS's 24 kHz, and they are the whole audio."""
    build_tiny_model(coqui_python, "xtts", tmp_path / "xtts")
    reference = write_wav(tmp_path / "voice.wav", speech("This is the voice to clone, for a few seconds."), 16_000)
    options = {"backend": "coqui", "coqui_model": str(tmp_path / "xtts"), "coqui_speaker": str(reference),
               "coqui_language": "en"}
    out = probe_synth(coqui_python, options, tmp_path / "out.npz")
    assert out["streams"] and int(out["sample_rate_hz"]) == 24_000
    assert len(out["piece_sizes"]) >= 2, "XTTS gave the phrase in one piece: it did not stream"
    assert set(out["piece_rates"]) == {24_000}
    np.testing.assert_array_equal(out["pieces"], out["audio"])
    audio = out["audio"]
    assert audio.dtype == np.float32 and np.sqrt(np.mean(audio**2)) > 1e-4 and np.all(np.isfinite(audio))
    missing_language, = probe_load(coqui_python, [options | {"coqui_language": ""}])
    assert missing_language["error"] == "ValueError" and "multilingual" in missing_language["message"]


def test_the_main_env_says_how_to_get_the_coqui_backend():
    if importlib.util.find_spec("TTS") is not None:
        pytest.skip("this interpreter has the TTS package")
    with pytest.raises(ModelNotFoundError, match="make coqui"):
        load_synthesizer(TtsOptions(backend="coqui", coqui_model="tts_models/en/ljspeech/vits"))


@pytest.fixture(scope="module")
def coqui_tts_service(coqui_python, tiny_vits, redis_url, tmp_path_factory):
    """`specvox up --tts-python <the Coqui env's python>` with the tiny VITS, on free ports and
    the tests' Valkey: the tts service runs in the Coqui env, the other three in this one."""
    checkpoint, config = tiny_vits
    env = {"SPECVOX_TTS__BACKEND": "coqui", "SPECVOX_TTS__COQUI_MODEL": checkpoint,
           "SPECVOX_TTS__COQUI_CONFIG": config}
    with specvox_up(redis_url, tmp_path_factory.mktemp("coqui-stack"), env, ("--tts-python", coqui_python)) as up:
        yield up["tts"]


def test_up_refuses_a_tts_python_that_does_not_exist(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.cli", "up", "--tts-python", str(tmp_path / "python")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"the tts interpreter '{tmp_path / 'python'}' does not exist" in done.stderr


def word(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum())


async def synthesize(address: str, text: str, sample_rate_hz: int = 0) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tts_grpc.TtsStub(channel)
        return [event async for event in stub.Synthesize(tts.SynthesizeRequest(text=text,
                                                                               sample_rate_hz=sample_rate_hz))]


async def test_the_tts_service_speaks_with_coqui(coqui_tts_service):
    events = await synthesize(coqui_tts_service, TEXT)
    chunks = [e.audio for e in events if e.WhichOneof("event") == "audio"]
    cues = [e.cue for e in events if e.WhichOneof("event") == "cue"]
    assert events[-1].WhichOneof("event") == "times"
    assert chunks and cues
    assert {c.sample_rate_hz for c in chunks} == {TINY_RATE_HZ}, "the service did not speak with the Coqui model"
    audio = np.concatenate([np.frombuffer(c.pcm_s16le, "<i2") / 32768.0 for c in chunks])
    assert np.sqrt(np.mean(audio**2)) > 1e-3
    for chunk, following in pairwise(chunks):  # each chunk starts where the one before ended
        assert following.start_s == pytest.approx(chunk.start_s + len(chunk.pcm_s16le) / 2 / TINY_RATE_HZ, abs=1e-3)
    assert chunks[0].start_s == 0.0
    assert cues[0].start_s == 0.0 and max(c.end_s for c in cues) == pytest.approx(audio.size / TINY_RATE_HZ, abs=0.01)
    assert all(0.0 <= c.start_s < c.end_s <= audio.size / TINY_RATE_HZ + 0.01 for c in cues)
    assert {word(w) for c in cues for w in c.text.split()} <= {word(w) for w in TEXT.split()}


async def test_the_coqui_tts_service_resamples_and_rejects_bad_input(coqui_tts_service):
    events = await synthesize(coqui_tts_service, "Hello there.", 24_000)
    assert {e.audio.sample_rate_hz for e in events if e.WhichOneof("event") == "audio"} == {24_000}
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "", synthesize(coqui_tts_service, "   "))
    assert await synthesize(coqui_tts_service, "Still here.")  # the service stays up


async def test_the_coqui_tts_service_sends_approximate_visemes_over_its_audio(coqui_tts_service):
    """Coqui reports no alignment: each sentence's phonemes (espeak-ng's) spread over its audio, marked
    approximate, tiling the reply's timeline and each sent just before the chunk it starts in."""
    events = await synthesize(coqui_tts_service, TEXT)
    chunks = [e.audio for e in events if e.WhichOneof("event") == "audio"]
    visemes = [e.viseme for e in events if e.WhichOneof("event") == "viseme"]
    audio_s = sum(len(c.pcm_s16le) / 2 for c in chunks) / TINY_RATE_HZ
    assert visemes and all(v.approximate for v in visemes)
    assert {v.id for v in visemes} - {"sil"}, "the phrase's sounds made no mouth shape"
    assert visemes[0].start_s == 0 and visemes[-1].end_s == pytest.approx(audio_s, abs=1 / TINY_RATE_HZ)
    assert all(0 <= b.start_s - a.end_s <= 1 / TINY_RATE_HZ for a, b in pairwise(visemes))
    pending = []
    for event in events:
        if event.WhichOneof("event") == "viseme":
            pending.append(event.viseme.start_s)
        elif event.WhichOneof("event") == "audio":
            end_s = event.audio.start_s + len(event.audio.pcm_s16le) / 2 / TINY_RATE_HZ
            assert all(event.audio.start_s - 1e-6 <= start_s < end_s for start_s in pending)
            pending = []
