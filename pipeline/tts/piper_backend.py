"""Piper synthesis of one phrase at a time, in pieces, with each word's place in the audio.

The voice's ONNX graph is split in memory (needs the `onnx` package) into its encoder
(phoneme ids → a prior per latent frame, and how many frames each phoneme id became:
the duration predictor's rounded widths, `w_ceil`), its flow (prior → latent frames)
and its decoder (HiFi-GAN: latent frames → audio). Flow and decoder are convolutional,
so a stretch of frames can be made alone given the frames either side within their
reach: a sentence's first audio is out after the encoder, the flow over a short head
and a short decode, rather than after the whole sentence, and the pieces join into the
same samples as one run of the whole graph. Piper's own synthesis scales each sentence
to full scale by its peak, known only once the sentence is decoded; here one gain per
voice, measured at load on a reference sentence, puts the voice at that level instead.

Word times come from the widths: words are the runs of phonemes between espeak's
word separators. So do the visemes (pipeline/tts/visemes.py): each phoneme's samples, exactly.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.audio import resample
from pipeline.models import resolve_piper_voice
from pipeline.tts import espeak_clauses
from pipeline.tts.backend import Synthesis, TtsOptions, WordTiming
from pipeline.tts.visemes import starting_in, visemes_from_alignment

__all__ = ["PiperSynthesizer", "TtsOptions", "phoneme_word_spans"]
log = logging.getLogger(__name__)
WORD_SEPARATOR = " "
FIRST_PIECE_FRAMES = 16  # a sentence's first piece: 0.19 s of audio (a frame is 256 samples at 22.05 kHz)
PIECE_GROWTH = 8  # a later piece is at most this many times the audio before it (decoding runs at RTF < 1/8)
# ... and at most this long (2 s): a piece is one call on the tts model thread, which cannot be cut
# short, so it bounds how long another turn's first phrase waits there (a 10 s sentence decoded
# whole took 575 ms on 2 idle cores, and under four sessions' load it held first phrases ~1 s).
MAX_PIECE_FRAMES = 172
LEVEL_REFERENCE = "Hello there, how can I help you today?"  # its peak sets the voice's gain
LEVEL_PEAK = 0.9  # the reference sentence's peak after the gain (Piper's own: 1.0 for every sentence)
DECODER_CONTEXT = 12  # the decoder's reach in latent frames: with this many either side, pieces join exactly
FLOW_CONTEXT = 32  # the flow's reach: 4 coupling layers, each 4 convolutions of width 5
DECODER_INPUT_NODE = "/dec/conv_pre/Conv"  # the decoder's first node in Piper's exported VITS graph
# Words whose espeak word count is remembered (`_espeak_words_in`): a reply's words mostly repeat,
# and each phonemization costs time (and, through piper's own bridge, leaked memory: see
# pipeline/tts/espeak_clauses.py, which the voice's phonemizer now uses instead).
REMEMBERED_WORDS = 4096


class PiperSynthesizer:
    name = "piper"

    def __init__(self, options: TtsOptions) -> None:
        from piper import PiperVoice
        from piper.config import PiperConfig

        files = resolve_piper_voice(options.voice)
        with open(files.config_path, encoding="utf-8") as f:
            config = PiperConfig.from_dict(json.load(f))
        self.model = _VoiceModel.load(str(files.model_path), options)
        # Piper's voice for its phonemizer and phoneme ids; the model runs here, in parts (not its synthesize)
        self.phonemizer = PiperVoice(config=config, session=self.model.encoder)
        espeak_clauses.use_for_piper()  # its clause phonemes and voice setting without the bridge's leaks
        self._espeak_words_in = functools.lru_cache(maxsize=REMEMBERED_WORDS)(self._count_espeak_words)
        self.sample_rate_hz = int(config.sample_rate)
        self.inputs: dict[str, np.ndarray] = {"scales": np.array([
            config.noise_scale if options.noise_scale is None else options.noise_scale,
            config.length_scale,
            config.noise_w_scale if options.noise_w_scale is None else options.noise_w_scale,
        ], dtype=np.float32)}
        if config.num_speakers > 1:
            self.inputs["sid"] = np.array([config.default_speaker_id or 0], dtype=np.int64)
        self.gain = self._level_gain()

    def _level_gain(self) -> float:
        """The gain that brings the reference sentence, spoken without noise, to LEVEL_PEAK."""
        voiced = self.inputs
        self.gain, self.inputs = 1.0, voiced | {"scales": voiced["scales"] * np.array([0, 1, 0], np.float32)}
        try:
            peak = float(np.abs(self.synthesize(LEVEL_REFERENCE)).max())
        finally:
            self.inputs = voiced
        return LEVEL_PEAK / max(peak, 1e-3)

    @property
    def aligned(self) -> bool:
        return self.model.aligned

    def warm_up(self) -> None:
        self.synthesize("Hello there.")

    def stream(self, text: str, after_s: float = 0.0) -> Iterator[Synthesis]:
        """Each sentence's audio in pieces as they are decoded, each with the words that end in it.

        A piece is at most `PIECE_GROWTH` times the audio out before it, `after_s` included:
        a reply's first sentence comes in a few pieces, those after it mostly whole.
        """
        out_frames = round(after_s * self.sample_rate_hz / self.phonemizer.config.hop_length)
        sentences = [s for s in self.phonemizer.phonemize(text) if s]
        words = text.split()
        groups = self._espeak_words_per_word(sentences, words) if self.aligned else None
        first = 0  # the text's next word
        for phonemes in sentences:
            phonemes = [p for p in phonemes if p in self.phonemizer.config.phoneme_id_map]  # those the voice can say
            widths, pieces = self.model.run(self.phonemizer.phonemes_to_ids(phonemes), self.inputs, out_frames)
            alignment = (self._phoneme_samples(phonemes, widths * self.phonemizer.config.hop_length)
                         if widths is not None else None)
            visemes = visemes_from_alignment(alignment, self.sample_rate_hz) if alignment is not None else ()
            spans: list[tuple[str, int, int]] | None = None
            if groups is not None and widths is not None:
                sizes = _take(groups, first, _count_words(phonemes))
                phoneme_spans = phoneme_word_spans(alignment) if alignment is not None else []
                if sizes is None or len(phoneme_spans) != sum(sizes):
                    groups = None  # lost track: the rest goes in proportion
                else:
                    spans = _word_spans(words[first : first + len(sizes)], sizes, phoneme_spans)
                    first += len(sizes)
            start, rate = 0, self.sample_rate_hz  # the piece's first sample in the sentence
            for audio in pieces:
                end, timings = start + audio.size, None
                if spans is not None:  # the words that end in this piece, timed from its start
                    ending = [span for span in spans if span[2] <= end]
                    spans = spans[len(ending) :]
                    timings = tuple(WordTiming(w, (a - start) / rate, (b - start) / rate) for w, a, b in ending)
                yield Synthesis(np.clip(audio * self.gain, -1.0, 1.0), rate, timings,
                                starting_in(visemes, start / rate, end / rate))
                start = end
            out_frames += start // self.phonemizer.config.hop_length

    def _espeak_words_per_word(self, sentences: list[list[str]], words: list[str]) -> list[int] | None:
        """How many words espeak makes of each word ("COVID-19" → 2); None if that does not add up."""
        total = sum(_count_words(p) for p in sentences)
        if total == len(words):
            return [1] * len(words)
        groups = [self._espeak_words_in(w) for w in words]
        if sum(groups) != total or 0 in groups:
            log.debug("espeak heard %d words in %r: timing it in proportion", total, " ".join(words))
            return None
        return groups

    def _count_espeak_words(self, word: str) -> int:
        return sum(_count_words(p) for p in self.phonemizer.phonemize(word))

    def _phoneme_samples(self, phonemes: list[str], samples_per_id: np.ndarray) -> list[tuple[str, int]] | None:
        """(phoneme, samples) from `^` to `$`: a phoneme's ids and the pad after it, as `phonemes_to_ids` lays them."""
        from piper.const import BOS, EOS, PAD

        id_map = self.phonemizer.config.phoneme_id_map
        marked = [BOS, *phonemes, EOS]
        counts = [len(id_map[p]) + len(id_map.get(PAD, [])) for p in marked[:-1]] + [len(id_map[EOS])]
        if sum(counts) != samples_per_id.size:
            return None
        samples = np.add.reduceat(samples_per_id, np.cumsum([0, *counts[:-1]]))
        return [(p, int(n)) for p, n in zip(marked, samples, strict=True)]

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


def _word_spans(words: list[str], sizes: list[int], spans: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """(word, first sample, end sample) of each text word, over the espeak words it became."""
    out, k = [], 0
    for word, size in zip(words, sizes, strict=True):
        out.append((word, spans[k][0], spans[k + size - 1][1]))
        k += size
    return out


@dataclass(frozen=True)
class _SplitPoints:
    """Where Piper's exported VITS graph is cut: the flow's input, the frame mask, the decoder's input."""

    prior: str  # z_p, the prior sampled for each frame
    mask: str
    latent: str  # the flow's output times the mask

    @classmethod
    def find(cls, graph: Any) -> _SplitPoints | None:
        made_by = {out: node for node in graph.node for out in node.output}
        decoder = next((node for node in graph.node if node.name == DECODER_INPUT_NODE), None)
        masked = made_by.get(decoder.input[0]) if decoder is not None else None
        flow_inputs = {name for node in graph.node if node.name.startswith("/flow/") for name in node.input}
        sums = {node.output[0] for node in graph.node if node.op_type == "Add" and not node.name.startswith("/flow/")}
        prior = flow_inputs & sums  # z_p = m_p + noise: the one sum from outside the flow that goes into it
        if decoder is None or masked is None or masked.op_type != "Mul" or len(prior) != 1:
            return None
        return cls(prior.pop(), masked.input[1], decoder.input[0])


@dataclass(frozen=True)
class _VoiceModel:
    """The voice's ONNX graph as it runs here: in three parts where it can be split, else whole.

    The encoder turns phoneme ids into the prior of each frame (and the widths); the flow
    (4 coupling layers) turns the prior into latent frames; the decoder makes their audio.
    Flow and decoder are convolutional, so each can work on a stretch of frames given
    enough context either side (`FLOW_CONTEXT`, `DECODER_CONTEXT`).
    """

    encoder: Any  # onnxruntime session: ids → prior, mask (unsplit: the audio) [, widths]
    flow: Any | None  # prior, mask → latent frames; None: the encoder is the whole model
    decoder: Any | None  # latent frames → audio
    points: _SplitPoints | None
    aligned: bool  # the encoder also gives each phoneme id's width in frames

    @classmethod
    def load(cls, model_path: str, options: TtsOptions) -> _VoiceModel:
        try:
            import onnx
            from onnx.utils import Extractor
        except ImportError:
            log.warning("the onnx package is missing (pip install 'piper-tts[alignment]'): "
                        "sentences are decoded whole and word times go in proportion")
            whole = _session(model_path, options)
            return cls(whole, None, None, None, len(whole.get_outputs()) > 1)
        proto = onnx.load(model_path)
        inputs = [i.name for i in proto.graph.input]
        speaker = [name for name in inputs if name == "sid"]
        audio = proto.graph.output[0].name
        widths = [out for node in proto.graph.node if node.op_type == "Ceil" for out in node.output][:1]
        points = _SplitPoints.find(proto.graph)
        extractor = Extractor(proto)
        if points is None:  # a graph exported otherwise: it runs whole
            whole = extractor.extract_model(inputs, [audio, *widths])
            return cls(_session(whole, options), None, None, None, bool(widths))
        encoder = extractor.extract_model(inputs, [points.prior, points.mask, *widths])
        flow = extractor.extract_model([points.prior, points.mask, *speaker], [points.latent])
        decoder = extractor.extract_model([points.latent, *speaker], [audio])
        return cls(_session(encoder, options), _session(flow, options), _session(decoder, options), points,
                   bool(widths))

    def run(self, ids: list[int], inputs: dict[str, np.ndarray],
            out_frames: int = 0) -> tuple[np.ndarray | None, Iterator[np.ndarray]]:
        """Each phoneme id's width in frames (None if unknown) at once; the audio in pieces, each when asked for.

        `out_frames`: the audio out before this sentence, in frames (see `_decode`).
        """
        feed = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64)}
        outputs = self.encoder.run(None, feed | inputs)
        widths = outputs[-1].reshape(-1).astype(np.int64) if self.aligned else None
        if self.points is None:
            return widths, iter([_audio(outputs[0])])
        return widths, self._decode(outputs[0], outputs[1], {k: v for k, v in inputs.items() if k == "sid"}, out_frames)

    def _decode(self, prior: np.ndarray, mask: np.ndarray, inputs: dict[str, np.ndarray],
                out_frames: int) -> Iterator[np.ndarray]:
        """Pieces of `PIECE_GROWTH` times the frames already out (at least `FIRST_PIECE_FRAMES`, at most
        `MAX_PIECE_FRAMES`), each decoded with the decoder's context and its flow with the flow's."""
        assert self.flow is not None and self.decoder is not None and self.points is not None
        frames, start = prior.shape[-1], 0
        while start < frames:
            size = min(MAX_PIECE_FRAMES, max(FIRST_PIECE_FRAMES, PIECE_GROWTH * (out_frames + start)))
            end = frames if frames - (start + size) < FIRST_PIECE_FRAMES else start + size
            low, high = max(0, start - DECODER_CONTEXT), min(frames, end + DECODER_CONTEXT)
            flow_low, flow_high = max(0, low - FLOW_CONTEXT), min(frames, high + FLOW_CONTEXT)
            latent = self._flow(prior[..., flow_low:flow_high], mask[..., flow_low:flow_high], inputs)
            latent = latent[..., low - flow_low : high - flow_low]
            audio = _audio(self.decoder.run(None, {self.points.latent: latent} | inputs)[0])
            per_frame = audio.size // (high - low)
            yield audio[(start - low) * per_frame : (end - low) * per_frame]
            start = end

    def _flow(self, prior: np.ndarray, mask: np.ndarray, inputs: dict[str, np.ndarray]) -> np.ndarray:
        assert self.flow is not None and self.points is not None
        return self.flow.run(None, {self.points.prior: prior, self.points.mask: mask} | inputs)[0]


def _audio(output: np.ndarray) -> np.ndarray:
    return np.clip(output.reshape(-1), -1.0, 1.0).astype(np.float32)


def _session(model: Any, options: TtsOptions) -> Any:
    """An onnxruntime session for the voice's graph or a part of it (a path or an ONNX model)."""
    import onnxruntime

    session_options = onnxruntime.SessionOptions()
    session_options.intra_op_num_threads = options.threads or (os.cpu_count() or 1)
    session_options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads yield the CPU
    # No arena and no memory patterns: onnxruntime's arena keeps what the largest shapes run so far
    # needed, so the service's memory rose with every longer sentence (+94 MB over 240 phrases
    # here); without them it stays level (300 MB throughout) at the same speed (docs/reliability.md).
    session_options.enable_cpu_mem_arena = False
    session_options.enable_mem_pattern = False
    providers: list[Any] = (
        [("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"})] if options.use_cuda
        else ["CPUExecutionProvider"]
    )
    source = model if isinstance(model, str) else model.SerializeToString()
    return onnxruntime.InferenceSession(source, sess_options=session_options, providers=providers)
