"""Piper synthesis of one phrase at a time, with each word's place in the audio.

Word times come from the voice itself: Piper 1.8 can expose how many audio samples
each phoneme id produced (its duration predictor's rounded widths, `w_ceil`), by
marking that tensor as a model output in memory (needs the `onnx` package). Words
are the runs of phonemes between espeak's word separators.
"""

from __future__ import annotations

import json
import logging
import os
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pipeline.audio import resample
from pipeline.models import resolve_piper_voice
from pipeline.tts.backend import Synthesis, TtsOptions, WordTiming

__all__ = ["PiperSynthesizer", "TtsOptions", "phoneme_word_spans"]
log = logging.getLogger(__name__)
WORD_SEPARATOR = " "


class PiperSynthesizer:
    name = "piper"

    def __init__(self, options: TtsOptions) -> None:
        from piper import PiperVoice
        from piper.config import PiperConfig, SynthesisConfig

        files = resolve_piper_voice(options.voice)
        with open(files.config_path, encoding="utf-8") as f:
            config = PiperConfig.from_dict(json.load(f))
        session, self.aligned = _session(str(files.model_path), options)
        self.voice = PiperVoice(config=config, session=session)
        self.sample_rate_hz = int(config.sample_rate)
        self.config = SynthesisConfig(noise_scale=options.noise_scale, noise_w_scale=options.noise_w_scale)

    def warm_up(self) -> None:
        self.synthesize("Hello there.")

    def stream(self, text: str) -> Iterator[Synthesis]:
        """One piece per sentence, as Piper synthesizes them, with word times when the voice aligns."""
        words = text.split()
        groups = self._espeak_words_per_word(text, words) if self.aligned else None
        first = 0  # the text's next word
        for chunk in self.voice.synthesize(text, self.config, include_alignments=self.aligned):
            audio = chunk.audio_float_array.astype(np.float32)
            timings = None
            if groups is not None:
                sizes = _take(groups, first, _count_words(chunk.phonemes))
                alignments = chunk.phoneme_alignments or []
                spans = phoneme_word_spans([(a.phoneme, int(a.num_samples)) for a in alignments])
                if sizes is None or len(spans) != sum(sizes):
                    groups = None  # lost track: the rest goes in proportion
                else:
                    timings = self._timings(words[first : first + len(sizes)], sizes, spans)
                    first += len(sizes)
            yield Synthesis(audio, self.sample_rate_hz, timings)

    def _espeak_words_per_word(self, text: str, words: list[str]) -> list[int] | None:
        """How many words espeak makes of each word ("COVID-19" → 2); None if that does not add up."""
        total = sum(_count_words(p) for p in self.voice.phonemize(text))
        if total == len(words):
            return [1] * len(words)
        groups = [sum(_count_words(p) for p in self.voice.phonemize(w)) for w in words]
        if sum(groups) != total or 0 in groups:
            log.debug("espeak heard %d words in %r: timing it in proportion", total, text)
            return None
        return groups

    def _timings(self, words: list[str], sizes: list[int], spans: list[tuple[int, int]]) -> tuple[WordTiming, ...]:
        out, k, rate = [], 0, self.sample_rate_hz
        for word, size in zip(words, sizes, strict=True):
            out.append(WordTiming(word, spans[k][0] / rate, spans[k + size - 1][1] / rate))
            k += size
        return tuple(out)

    def synthesize(self, text: str, sample_rate_hz: int = 0) -> np.ndarray:
        """Mono float32 audio of `text` at `sample_rate_hz` (0: the voice's rate)."""
        parts = [piece.audio for piece in self.stream(text)]
        audio = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return resample(audio, self.sample_rate_hz, sample_rate_hz or self.sample_rate_hz)


def phoneme_word_spans(alignments: Sequence[tuple[str, int]]) -> list[tuple[int, int]]:
    """(first, last) sample of each word: the runs of speech phonemes between separators.

    `alignments` is Piper's (phoneme, samples) list, beginning-of-sentence and
    end-of-sentence marks included; pauses (punctuation, separators) belong to no word.
    """
    spans: list[tuple[int, int]] = []
    position, start, end = 0, -1, -1
    for phoneme, samples in alignments:
        if phoneme == WORD_SEPARATOR and start >= 0:
            spans.append((start, end))
            start = -1
        elif _is_speech(phoneme):
            start = position if start < 0 else start
            end = position + samples
        position += samples
    if start >= 0:
        spans.append((start, end))
    return spans


def _take(groups: list[int], first: int, espeak_words: int) -> list[int] | None:
    """The espeak-word counts of the text's words from `first` that make up a sentence of `espeak_words`."""
    taken: list[int] = []
    while sum(taken) < espeak_words and first + len(taken) < len(groups):
        taken.append(groups[first + len(taken)])
    return taken if sum(taken) == espeak_words else None


def _count_words(phonemes: Sequence[str]) -> int:
    return len(phoneme_word_spans([(p, 1) for p in phonemes]))


def _is_speech(phoneme: str) -> bool:
    """IPA letters, length and stress marks; not punctuation, not Piper's ^ and $ marks."""
    return bool(phoneme) and unicodedata.category(phoneme[0])[0] in "LM"


def _session(model_path: str, options: TtsOptions) -> tuple[Any, bool]:
    """An onnxruntime session for the voice, patched in memory to report phoneme widths if it can."""
    import onnxruntime

    model: str | bytes = model_path
    try:
        import onnx
        from piper.patch_voice_with_alignment import add_alignment_output

        proto = onnx.load(model_path)
        add_alignment_output(proto)
        model = proto.SerializeToString()
    except ImportError:
        log.warning("the onnx package is missing (pip install 'piper-tts[alignment]'): word times in proportion")
    except ValueError:  # already patched on disk, or no width tensor to expose: the session's outputs say
        pass
    session_options = onnxruntime.SessionOptions()
    session_options.intra_op_num_threads = options.threads or (os.cpu_count() or 1)
    session_options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads yield the CPU
    providers: list[Any] = (
        [("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"})] if options.use_cuda
        else ["CPUExecutionProvider"]
    )
    session = onnxruntime.InferenceSession(model, sess_options=session_options, providers=providers)
    return session, len(session.get_outputs()) > 1
