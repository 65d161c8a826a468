"""Several closed utterances in one whisper pass, for files: the same steps as `Transcriber.transcribe`,
batched as faster-whisper's `BatchedInferencePipeline` batches them.

faster-whisper's `BatchedInferencePipeline.forward` encodes a batch of windows at once, decodes them
with one `generate` call (CTranslate2 steps the batch's sequences together) and aligns their words
with one `align` call. It finds its windows with its own VAD over the whole audio held in memory;
here the windows are the utterances `UtteranceSegmenter` closed, so a file is cut exactly as the
live asr stage cuts a stream and only a batch of utterances is held at once. Each utterance's pass
keeps `Transcriber.transcribe`'s choices: its encoder input (`Transcriber.encoder_features`: the
audio and digital silence, here as long as the batch's longest needs), its greedy decoding options,
its repetition guard, whisper's own silence check and measures (no-speech probability, mean log
probability, compression ratio), and its segments (`pipeline.asr.segments_of`). On this 2-core CPU
four utterances a pass took 1.13 s of CPU for a minute of speech against 1.91 s one at a time, and
eight no less than four (a batch pads to its longest utterance): docs/captions.md has the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pipeline.asr import (
    MAX_TOKENS_PER_S,
    SAMPLE_RATE_HZ,
    Transcriber,
    Transcript,
    Utterance,
    _decoding_options,
    _shift_words,
    join_words,
    segments_of,
)


class BatchTranscriber:
    """`Transcriber`'s model on several utterances at a time; blocking."""

    def __init__(self, transcriber: Transcriber) -> None:
        self.transcriber = transcriber
        self._decoding = _decoding_options(transcriber.model, transcriber.options)

    def transcribe(self, utterances: Sequence[Utterance], language: str | None = None) -> list[Transcript]:
        """Each utterance's transcript, in order. `language`: None for the options' own; "" (detect) on a
        multilingual model takes one utterance a pass, as the language is found from each one's audio."""
        language = self.transcriber.options.language if language is None else language
        if len(utterances) == 1 or (not language and self.transcriber.model.model.is_multilingual):
            return [self.transcriber.transcribe(u, language) for u in utterances]
        return self._batch(list(utterances), language) if utterances else []

    def _batch(self, utterances: list[Utterance], language: str) -> list[Transcript]:
        import ctranslate2
        from faster_whisper.transcribe import get_compression_ratio

        transcriber, model = self.transcriber, self.transcriber.model
        extractor = model.feature_extractor
        samples = max(transcriber.encoder_samples(u.audio.size) for u in utterances)
        features = np.stack([transcriber.encoder_features(u.audio, samples) for u in utterances])
        frames = [min(u.audio.size // extractor.hop_length, extractor.nb_max_frames) for u in utterances]
        encoder_output = model.encode(features)
        tokenizer = transcriber._tokenizer(language, encoder_output)
        options = self._decoding
        prompt = model.get_prompt(tokenizer, [], without_timestamps=options.without_timestamps)
        longest_s = max(u.audio.size for u in utterances) / SAMPLE_RATE_HZ
        options = replace(options, max_new_tokens=MAX_TOKENS_PER_S * (1 + int(longest_s)))
        results = model.model.generate(
            encoder_output, [list(prompt) for _ in utterances], beam_size=options.beam_size,
            patience=options.patience, length_penalty=options.length_penalty,
            max_length=len(prompt) + options.max_new_tokens, suppress_blank=options.suppress_blank,
            suppress_tokens=options.suppress_tokens, return_scores=True, return_no_speech_prob=True,
            sampling_temperature=options.temperatures[0], repetition_penalty=options.repetition_penalty,
            no_repeat_ngram_size=options.no_repeat_ngram_size,
            max_initial_timestamp_index=int(round(options.max_initial_timestamp / model.time_precision)))
        measures, segments = [], []
        asr = transcriber.options
        for result, n in zip(results, frames, strict=True):
            tokens = result.sequences_ids[0]
            avg_logprob = result.scores[0] * len(tokens) ** options.length_penalty / (len(tokens) + 1)
            measures.append({"no_speech_prob": result.no_speech_prob, "avg_logprob": avg_logprob,
                             "compression_ratio": get_compression_ratio(tokenizer.decode(tokens).strip())})
            silent = result.no_speech_prob > asr.no_speech_probability and avg_logprob <= asr.no_speech_logprob
            text = any(t < tokenizer.eot for t in tokens)
            segments.append(segments_of(model, tokenizer, tokens, n) if text and not silent else None)
        spoken = [i for i, s in enumerate(segments) if s]
        if spoken:
            encoded = encoder_output
            if len(spoken) < len(utterances):  # align only those with words: the batch's rows, copied
                encoded = ctranslate2.StorageView.from_array(np.ascontiguousarray(np.asarray(encoder_output)[spoken]))
            model.add_word_timestamps([segments[i] for i in spoken], tokenizer, encoded, [frames[i] for i in spoken],
                                      options.prepend_punctuations, options.append_punctuations,
                                      last_speech_timestamp=0.0)
        transcripts = []
        for split, u, measured in zip(segments, utterances, measures, strict=True):
            words = tuple(_shift_words(split, u.audio_start_s)) if split else ()
            transcripts.append(Transcript(text=join_words(words), words=words, **measured))
        return transcripts
