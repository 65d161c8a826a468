"""Every stage loads a model named by path with the same code as its bundled one; missing ones say what to do."""

from __future__ import annotations

import pytest
import torch

from pipeline.asr import AsrOptions, Transcriber
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions
from pipeline.models import ModelNotFoundError, resolve_asr, resolve_piper_voice
from pipeline.tts.piper_backend import PiperSynthesizer, TtsOptions


def test_llm_loads_a_local_folder_in_the_requested_dtype(tiny_llm_dir):
    loaded = load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float64"))
    assert next(loaded.model.parameters()).dtype == torch.float64
    assert loaded.context_tokens == 512
    steps = list(Generator(loaded).steps(GenerationRequest((1, 2, 3), max_new_tokens=6)))
    assert sum(s.accepted for s in steps) >= 1 and steps[-1].finish_reason in ("eos", "length")


def test_asr_and_tts_load_their_models_by_path(synthesizer):
    explicit = Transcriber(AsrOptions(model=resolve_asr("bundled")))
    assert explicit.model is not None
    voice = resolve_piper_voice("bundled")
    by_path = PiperSynthesizer(TtsOptions(voice=voice.model_path))
    assert by_path.sample_rate_hz == synthesizer.sample_rate_hz == 22_050
    assert by_path.synthesize("Hi.").size > 0


@pytest.mark.parametrize("load, message", [
    (lambda: load_model(LlmOptions(model="/no/such/model.gguf")), "GGUF file not found"),
    (lambda: load_model(LlmOptions(model="someone/not-cached-model")), "SPECVOX_LLM__OFFLINE=false"),
    (lambda: Transcriber(AsrOptions(model="not-a-cached-whisper")), "SPECVOX_ASR__OFFLINE=false"),
    (lambda: PiperSynthesizer(TtsOptions(voice="/no/such/voice.onnx")), "Piper voice file not found"),
])
def test_missing_models_raise_a_clear_error(load, message):
    with pytest.raises(ModelNotFoundError, match=message):
        load()


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(LlmOptions(dtype="float8"))
