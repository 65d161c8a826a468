"""Coqui TTS synthesis of one phrase at a time (blocking: services run it in a thread).

The `TTS` package (the maintained `coqui-tts` distribution) needs a torch, torchaudio and
torchcodec that do not sit beside the project's own torch, so it lives in its own
environment (`make coqui` builds .venv-coqui) and is imported only when this backend loads.

A model comes by name from the local Coqui model folder (or, for the models Coqui keeps on
the Hugging Face Hub, such as XTTS, the local Hub cache), or as a checkpoint and its config.
Nothing is downloaded here: a model missing from the local folders is an error that says
how to fetch it. XTTS streams its audio as the GPT decodes (`inference_stream`); the other
models give one piece per sentence.

Coqui's models do not report where each phoneme fell, so a sentence's visemes are approximate:
its phonemes (the model's own phonemizer's, or espeak-ng's through piper-tts, which this
environment carries for the Piper backend) spread over its voiced audio in proportion to their
typical lengths (pipeline/tts/visemes.py). XTTS's streamed pieces come before the sentence's
length is known: they carry none.
"""

from __future__ import annotations

import functools
import logging
import os
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.audio import resample
from pipeline.models import ModelNotFoundError
from pipeline.tts.backend import Synthesis, TtsOptions
from pipeline.tts.visemes import Viseme, proportional_alignment, visemes_from_alignment

__all__ = ["CoquiSynthesizer", "TtsOptions"]
log = logging.getLogger(__name__)
ESPEAK_VOICE = "en-us"  # espeak-ng's voice for a model with no language of its own and no phonemizer

INSTALL_HINT = "the Coqui backend needs the TTS package of coqui-tts: run `make coqui` and use .venv-coqui/bin/python"


def _import_tts() -> Any:
    try:
        from TTS.api import TTS
    except ImportError as error:
        raise ModelNotFoundError(f"{INSTALL_HINT} ({error})") from error
    return TTS


def coqui_model_not_found(name: str, where: str) -> ModelNotFoundError:
    """A named model that is not in the local model folders; in the style of `not_found_offline`."""
    return ModelNotFoundError(
        f"tts model {name!r} is not in {where} (downloads are off: fetch it once with "
        f"`.venv-coqui/bin/tts --model_name {name} --text hello --out_path /tmp/hello.wav`, "
        "or name a local checkpoint with tts.coqui_model and tts.coqui_config)"
    )


def _local_model_paths(name: str) -> tuple[str, str]:
    """(checkpoint file or folder, config path) of a named model already on this machine.

    The Coqui models on GitHub unpack into the user data folder (~/.local/share/tts, or
    $TTS_HOME/tts); those on the Hugging Face Hub live in the Hub cache. Either way, only
    what is already local is looked at.
    """
    from TTS.utils.manage import ModelManager

    manager = ModelManager(progress_bar=False)
    parts = name.split("/")
    try:
        model_type, language, dataset, model = parts
        item = manager.models_dict[model_type][language][dataset][model]
    except (ValueError, KeyError):
        raise ModelNotFoundError(
            f"unknown Coqui model name {name!r}: names look like tts_models/en/ljspeech/vits "
            "(`.venv-coqui/bin/tts --list_models` lists them), or set tts.coqui_model to a checkpoint path"
        ) from None
    if model_type != "tts_models":
        raise ModelNotFoundError(f"{name!r} is not a text-to-speech model (tts_models/...)")
    if item.get("default_vocoder"):
        raise ModelNotFoundError(
            f"{name!r} needs a separate vocoder ({item['default_vocoder']}), which this backend does not load: "
            "choose an end-to-end model (VITS, XTTS) or a local checkpoint"
        )
    if "repo_id" in item:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            folder = Path(snapshot_download(item["repo_id"], allow_patterns=item.get("allow"),
                                            ignore_patterns=item.get("ignore"), local_files_only=True))
        except LocalEntryNotFoundError:
            raise coqui_model_not_found(name, f"the local Hugging Face cache (repo {item['repo_id']})") from None
    else:
        folder = Path(manager.output_prefix) / f"{model_type}--{language}--{dataset}--{model}"
        if not folder.is_dir():
            raise coqui_model_not_found(name, f"the local Coqui model folder {folder.parent}")
    config = folder / "config.json"
    if (folder / "model.pth").is_file() and config.is_file():
        return str(folder), str(config)  # XTTS and its kind load from their folder (speakers file beside)
    checkpoint, config = ModelManager._find_files(folder)
    return str(checkpoint), str(config)


def _check_paths(checkpoint: str, config: str) -> tuple[str, str]:
    checkpoint_path, config_path = Path(checkpoint).expanduser(), Path(config).expanduser() if config else None
    if not checkpoint_path.exists():
        raise ModelNotFoundError(f"Coqui checkpoint not found: {checkpoint_path}")
    if config_path is None:
        config_path = (checkpoint_path if checkpoint_path.is_dir() else checkpoint_path.parent) / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"Coqui config not found: {config_path} (set tts.coqui_config to its config.json)")
    return str(checkpoint_path), str(config_path)


class CoquiSynthesizer:
    name = "coqui"

    def __init__(self, options: TtsOptions) -> None:
        if not options.coqui_model:
            raise ModelNotFoundError("tts.backend is coqui but tts.coqui_model is empty: name a model or a checkpoint")
        tts_class = _import_tts()
        if options.threads:
            import torch

            torch.set_num_threads(options.threads)  # tts runs in its own process: this is its share of the cores
        looks_like_name = options.coqui_model.startswith("tts_models/") and not os.path.exists(options.coqui_model)
        if looks_like_name and not options.coqui_config:
            checkpoint, config = _local_model_paths(options.coqui_model)
        else:
            checkpoint, config = _check_paths(options.coqui_model, options.coqui_config)
        self.tts = tts_class(model_path=checkpoint, config_path=config, progress_bar=False).to(options.device)
        self.synthesizer = self.tts.synthesizer
        self.model = self.synthesizer.tts_model
        self.sample_rate_hz = int(self.synthesizer.output_sample_rate)
        self.language = options.coqui_language or None
        self.speaker, self.speaker_wav = self._speaker(options.coqui_speaker)
        self._check_language()
        self._set_noise(options.noise_scale, options.noise_w_scale)
        self._latents: tuple[Any, Any] | None = None

    @property
    def streams(self) -> bool:
        """True for models that yield audio while they decode (XTTS)."""
        return hasattr(self.model, "inference_stream")

    def _speaker(self, speaker: str) -> tuple[str | None, str | None]:
        """A speaker name, or a reference recording (a WAV path) for models that clone a voice."""
        if speaker and Path(speaker).expanduser().is_file():
            return None, str(Path(speaker).expanduser())
        manager = getattr(self.model, "speaker_manager", None)
        names = list(manager.speaker_names) if manager is not None and manager.num_speakers > 1 else []
        clones = bool(getattr(self.model.config, "supports_cloning", False))
        if not names and not clones:
            if speaker:
                raise ValueError(f"this Coqui model has one speaker; tts.coqui_speaker={speaker!r} does not apply")
            return None, None
        if not speaker or speaker not in names:
            choices = [f"one of {_few(names)}"] if names else []
            choices += ["a WAV recording of the voice"] if clones else []
            problem = f"unknown Coqui speaker {speaker!r}" if speaker else "this Coqui model has several voices"
            raise ValueError(f"{problem}: set tts.coqui_speaker to {' or '.join(choices)}")
        return speaker, None

    def _check_language(self) -> None:
        languages = self.tts.languages if self.tts.is_multi_lingual else None
        if languages is None:
            if self.language:
                raise ValueError(f"this Coqui model is not multilingual; tts.coqui_language={self.language!r} "
                                 "does not apply")
            return
        if not self.language:
            raise ValueError(f"this Coqui model is multilingual: set tts.coqui_language to one of {_few(languages)}")
        if self.language not in languages and self.language.split("-")[0] not in languages:
            raise ValueError(f"unknown Coqui language {self.language!r}: choose one of {_few(languages)}")

    def _set_noise(self, noise_scale: float | None, noise_w_scale: float | None) -> None:
        """VITS's sampling noise (of the flow, and of the duration predictor); 0 makes it deterministic."""
        if noise_scale is not None and hasattr(self.model, "inference_noise_scale"):
            self.model.inference_noise_scale = noise_scale
        if noise_w_scale is not None and hasattr(self.model, "inference_noise_scale_dp"):
            self.model.inference_noise_scale_dp = noise_w_scale

    def warm_up(self) -> None:
        self.synthesize("Hello there.")

    def stream(self, text: str, after_s: float = 0.0) -> Iterator[Synthesis]:
        """XTTS: pieces as the model decodes them. Others: one piece per sentence (`after_s` changes neither)."""
        if not text.strip():
            return
        if self.streams:
            yield from self._stream_xtts(text)
            return
        for sentence in self.synthesizer.split_into_sentences(text, self.language):
            if sentence.strip():
                audio = self._sentence(sentence)
                yield Synthesis(audio, self.sample_rate_hz, visemes=self._visemes(sentence, audio))

    def _visemes(self, sentence: str, audio: np.ndarray) -> tuple[Viseme, ...]:
        """The sentence's visemes, spread over its audio in proportion (approximate); none without phonemes."""
        phonemes = self._phonemes(sentence)
        if not phonemes:
            return ()
        alignment = proportional_alignment(phonemes, audio, self.sample_rate_hz)
        return visemes_from_alignment(alignment, self.sample_rate_hz, approximate=True)

    def _phonemes(self, sentence: str) -> list[str]:
        """The sentence's IPA, a code point at a time: the model's own phonemizer's where it has one,
        else espeak-ng's (piper-tts's bridge); none if neither can say it."""
        phonemizer = getattr(getattr(self.model, "tokenizer", None), "phonemizer", None)
        try:
            if phonemizer is not None:
                ipa = phonemizer.phonemize(sentence, separator="", language=self.language)
            else:
                ipa = " ".join("".join(s) for s in _espeak().phonemize(self.language or ESPEAK_VOICE, sentence))
        except Exception as error:  # lip-sync is worth no failed sentence
            log.warning("no visemes for %r: its phonemes failed (%s)", sentence[:40], error)
            return []
        return list(unicodedata.normalize("NFD", ipa))

    def _sentence(self, sentence: str) -> np.ndarray:
        from TTS.utils import synthesizer as coqui_synthesizer

        wav = np.asarray(self.tts.tts(sentence, speaker=self.speaker, language=self.language,
                                      speaker_wav=self.speaker_wav, split_sentences=False), dtype=np.float32)
        pad = getattr(coqui_synthesizer, "PAD_SILENCE_SAMPLES", 0)  # the pause Coqui appends after each sentence
        if pad and wav.size >= pad and not wav[-pad:].any():
            wav = wav[:-pad]
        return wav

    def _stream_xtts(self, text: str) -> Iterator[Synthesis]:
        import torch

        gpt_cond_latent, speaker_embedding = self._conditioning()
        with torch.inference_mode():
            for chunk in self.model.inference_stream(text, self.language, gpt_cond_latent, speaker_embedding):
                audio = chunk.detach().float().cpu().numpy().reshape(-1)
                if audio.size:
                    yield Synthesis(audio.astype(np.float32), self.sample_rate_hz)

    def _conditioning(self) -> tuple[Any, Any]:
        """XTTS's voice: a built-in speaker's latents, or those of a reference recording (once)."""
        if self._latents is None:
            if self.speaker_wav:
                self._latents = self._latents_of_recording(self.speaker_wav)
            else:
                gpt_cond_latent, speaker_embedding = self.model.speaker_manager.speakers[self.speaker].values()
                self._latents = (gpt_cond_latent, speaker_embedding)
        return self._latents

    def _latents_of_recording(self, path: str) -> tuple[Any, Any]:
        """XTTS's `get_conditioning_latents`, reading the WAV with soundfile rather than torchaudio
        (whose loader, torchcodec, needs FFmpeg's shared libraries on the system)."""
        import soundfile
        import torch

        config = self.model.config
        rate = 22_050  # the rate XTTS's own loader reads references at
        samples, file_rate = soundfile.read(path, dtype="float32", always_2d=True)
        audio = resample(samples.mean(axis=1), file_rate, rate)[: rate * int(getattr(config, "max_ref_len", 30))]
        if getattr(config, "sound_norm_refs", False):
            audio = audio / max(float(np.abs(audio).max()), 1e-9) * 0.75
        reference = torch.from_numpy(np.ascontiguousarray(audio))[None].to(self.model.device)
        speaker_embedding = self.model.get_speaker_embedding(reference, rate)
        gpt_cond_latent = self.model.get_gpt_cond_latents(reference, rate, length=getattr(config, "gpt_cond_len", 6),
                                                          chunk_length=getattr(config, "gpt_cond_chunk_len", 6))
        return gpt_cond_latent, speaker_embedding

    def synthesize(self, text: str, sample_rate_hz: int = 0) -> np.ndarray:
        """Mono float32 audio of `text` at `sample_rate_hz` (0: the model's rate)."""
        parts = [piece.audio for piece in self.stream(text)]
        audio = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return resample(audio, self.sample_rate_hz, sample_rate_hz or self.sample_rate_hz)


@functools.cache
def _espeak() -> Any:
    """piper-tts's espeak-ng phonemizer, without its bridge's leaks (pipeline/tts/espeak_clauses.py)."""
    from piper.phonemize_espeak import EspeakPhonemizer

    from pipeline.tts import espeak_clauses

    espeak_clauses.use_for_piper()
    return EspeakPhonemizer()


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")
