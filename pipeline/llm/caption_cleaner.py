"""A transcript cleaned into a caption by the target, held to the transcript's words (caption_constraint.py)
and drafted from the transcript itself; several transcripts share each verification pass (batch.py).

The one way specvox turns a transcript into a caption text, for the llm stage's caption turns and for files
(pipeline/file_captions.py): there is no unconstrained rewrite to reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeline.llm.batch import BatchedDecoder
from pipeline.llm.engine import TRANSCRIPT, DecodeStep, GenerationRequest, GenerationStats, Generator
from pipeline.llm.model import auto_weights
from pipeline.llm.options import LlmOptions, SamplingOptions
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from pipeline.models import resolve_llm

# a caption's token limit per transcript token: digits and the marks between words (", “") add some
CAPTION_TOKENS_PER_TOKEN = 4
CAPTION_EXTRA_TOKENS = 16
# the weight form files are cleaned in where `llm.weights=auto` would load int4-exact (file_cleaning_options)
FILE_WEIGHTS = "int4-q8"


def file_cleaning_options(options: LlmOptions) -> LlmOptions:
    """The llm options a file's captions are cleaned with (`specvox captions`): the configured ones, but
    where `llm.weights=auto` would load int4-exact, int4-q8: the same Q4_1 codes on 8-bit activations with
    integer products (llama.cpp's arithmetic), not float32's to the bit. A caption's words are the
    transcript's whatever the weights (the constraint), so only a choice of casing, punctuation or digits can
    differ: 1 of 34 captions of `specvox bench captions`' clips did, its WER the same, and the files ran at
    22.2× real time against 17.1× on this 2-core CPU (docs/benchmarks/README.md). A form set explicitly
    (llm.weights, or `specvox captions --weights`) is kept."""
    if options.weights != "auto":
        return options
    form, _ = auto_weights(options, resolve_llm(options.model))
    return replace(options, weights=FILE_WEIGHTS) if form == "int4-exact" else options


def caption_token_limit(tokenizer: object, transcript: str) -> int:
    """Room for any faithful caption of `transcript` the model is likely to write (a longer one is cut, and a
    cut caption still says nothing that was not said)."""
    ids = tokenizer.encode(transcript, add_special_tokens=False)  # type: ignore[attr-defined]
    return CAPTION_TOKENS_PER_TOKEN * len(ids) + CAPTION_EXTRA_TOKENS


def caption_request(generator: Generator, transcript: str, drafter: str = TRANSCRIPT,
                    sampling: SamplingOptions = SamplingOptions(), max_draft_tokens: int = 8,
                    session_key: str = "") -> GenerationRequest:
    """The request that writes `transcript`'s caption: the caption prompt, a token limit from the transcript,
    and the transcript as the constraint (`caption_of`)."""
    tokenizer = generator.loaded.tokenizer
    prompt = encode_chat(tokenizer, chat_messages(Task.CAPTION, transcript))
    return GenerationRequest(tuple(prompt), caption_token_limit(tokenizer, transcript), drafter, sampling,
                             max_draft_tokens=max_draft_tokens, session_key=session_key, caption_of=transcript)


@dataclass(frozen=True)
class CleanedCaption:
    text: str
    stats: GenerationStats | None  # tokens, verify passes, accepted drafts (None: an empty transcript)
    cut: bool = False  # the token limit cut the caption: `text` is the transcript as it was


class CaptionCleaner:
    """Captions of transcripts, one at a time or `max_batch_size` to a verification pass.

    One at a time by default: on this 2-core CPU (int4-q8, 16 captions of 401 words, 2026-12-06) they took
    6.4 s one by one and 32 s four to a pass: a caption's drafts are long (the transcript), so a batch's pass
    holds rows × 9 positions, and a CPU pass costs what its positions cost. On a GPU a batch should pay."""

    def __init__(self, generator: Generator, drafter: str = TRANSCRIPT,
                 sampling: SamplingOptions = SamplingOptions(), max_batch_size: int = 1) -> None:
        self.generator, self.drafter, self.sampling = generator, drafter, sampling
        self.max_batch_size = max_batch_size
        # every caption's prompt starts with the same instruction: kept in the prefix cache under this key
        self.session_key = "captions"

    def request(self, transcript: str) -> GenerationRequest:
        return caption_request(self.generator, transcript, self.drafter, self.sampling, session_key=self.session_key)

    def clean(self, transcript: str) -> CleanedCaption:
        return self.clean_many([transcript])[0]

    def clean_many(self, transcripts: Sequence[str]) -> list[CleanedCaption]:
        """Each transcript's caption, in order; up to `max_batch_size` decoded together (a pass reads the
        weights once for all its rows)."""
        out: dict[int, CleanedCaption] = {i: CleanedCaption("", None) for i, t in enumerate(transcripts)
                                          if not t.strip()}
        todo = [i for i in range(len(transcripts)) if i not in out]
        if self.max_batch_size == 1:
            for i in todo:
                steps = list(self.generator.steps(self.request(transcripts[i])))
                out[i] = _cleaned(transcripts[i], "".join(s.text_delta for s in steps), steps[-1])
            return [out[i] for i in range(len(transcripts))]
        batch = BatchedDecoder(self.generator, self.max_batch_size)
        texts: dict[int, list[str]] = {}
        rows: dict[int, int] = {}  # id(decoder) -> transcript index
        while todo or batch.active:
            while todo and batch.room > 0:
                i = todo.pop(0)
                rows[id(batch.add(self.request(transcripts[i])))] = i
                texts[i] = []
            for row, step in batch.step():
                i = rows[id(row)]
                texts[i].append(step.text_delta)
                if step.finish_reason:
                    out[i] = _cleaned(transcripts[i], "".join(texts[i]), step)
        return [out[i] for i in range(len(transcripts))]


def _cleaned(transcript: str, caption: str, last: DecodeStep) -> CleanedCaption:
    """The caption, or where its token limit cut it (and so lost the words after the cut), the transcript."""
    text = transcript if last.finish_reason == "length" else caption
    return CleanedCaption(" ".join(text.split()), last.stats, last.finish_reason == "length")
