"""`specvox captions INPUT`: a media file's timed captions, in this process (no `specvox up`).

WAV, FLAC, MP3, or the audio of an MP4, MKV or WebM video, to WebVTT, SRT or JSON with word times
(pipeline/file_captions.py); each transcript cleaned by the LLM held to its words
(pipeline/llm/caption_cleaner.py; `--cleaner identity`: the transcript verbatim, without loading the
LLM); a progress bar with an ETA on stderr, the document to `--out` or stdout. Exit statuses
(docs/captions.md): 0 captions written (a file with no speech gets a valid document with no cues), 2 a
usage error or a file that cannot be captioned (not a media file, corrupt, no audio stream, longer than
`--max-duration-s`), 1 anything else (a model missing, the output not writable), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from services.cli.command import Command

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
FORMATS = ("vtt", "srt", "json")  # pipeline.file_captions.FORMATS, without loading the pipeline to parse
DEFAULT_MAX_DURATION_S = 3 * 3600  # pipeline.media.DEFAULT_MAX_DURATION_S
CLEANERS = ("llm", "identity")
WEIGHTS = ("auto", "dense", "int4-exact", "int4-q8", "int4")  # pipeline.llm.lean_llama's, without loading it


def captions_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="a WAV, FLAC or MP3 file, or an MP4, MKV or WebM video")
    parser.add_argument("--out", default="", help="the caption file (default: standard output)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="vtt (WebVTT), srt, or json (cues and word times); default: --out's extension, else vtt")
    parser.add_argument("--max-duration-s", type=float, default=DEFAULT_MAX_DURATION_S,
                        help="refuse a longer file (default: 3 hours); 0: no limit")
    parser.add_argument("--cleaner", choices=CLEANERS, default="llm",
                        help="llm: each transcript cleaned into a caption by the LLM, which can only drop fillers and "
                             "repetitions and set casing, punctuation and numbers (default); identity: the "
                             "transcript as it is, without loading the LLM (faster)")
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help="the LLM's weight form (default: int4-q8 where llm.weights=auto would load int4-exact, "
                             "llama.cpp's arithmetic on the same codes, ~1.3x faster; else llm.weights)")
    parser.add_argument("--chars-per-s", type=float, default=None,
                        help="the cues' reading speed at most, characters a second (default: the captions."
                             "max_chars_per_s setting, 17 for adults; 13 for children's programmes)")
    parser.add_argument("--batch", type=int, default=None, help="utterances per whisper pass (default: 4)")
    parser.add_argument("--threads", type=int, default=None,
                        help="whisper's CPU threads (default: one per core, at most 4)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary on stderr")


def output_format(args: argparse.Namespace) -> str:
    if args.format:
        return args.format
    suffix = Path(args.out).suffix.lower().lstrip(".")
    return {"webvtt": "vtt"}.get(suffix, suffix) if suffix in (*FORMATS, "webvtt") else "vtt"


def run_captions(settings, args: argparse.Namespace) -> int:
    from pipeline.file_captions import FileCaptioner, FileCaptionOptions
    from pipeline.media import MediaAudio, MediaError, MediaTooLong
    from pipeline.models import ModelNotFoundError

    if args.batch is not None and args.batch < 1:
        return _refuse("--batch must be at least 1")
    if args.threads is not None and args.threads < 1:
        return _refuse("--threads must be at least 1")
    if args.chars_per_s is not None and args.chars_per_s <= 0:
        return _refuse("--chars-per-s must be positive")
    style = settings.captions if args.chars_per_s is None else replace(settings.captions,
                                                                       max_chars_per_s=args.chars_per_s)
    fmt = output_format(args)
    limit = args.max_duration_s if args.max_duration_s > 0 else float("inf")
    options = FileCaptionOptions(max_duration_s=limit, style=style, whisper_threads=args.threads or 0,
                                 vad_threshold=settings.caption_vad_threshold, vad_gain_db=settings.caption_vad_gain_db,
                                 **({"batch_utterances": args.batch} if args.batch else {}))
    try:
        with MediaAudio(args.input, options.max_duration_s) as media:  # checked before the models load
            if not args.quiet:
                print(f"specvox captions: {describe(media.info)}; loading the models …", file=sys.stderr, flush=True)
            try:
                cleaner = caption_cleaner(settings, args.cleaner, args.weights)
            except ValueError as e:  # a weight form this machine or these settings cannot run
                return _refuse(str(e))
            captioner = FileCaptioner(settings.asr, options, cleaner=cleaner)
            with _ProgressBar(media.info.duration_s, disabled=args.quiet) as bar:
                result = captioner.caption(media, bar.update)
    except KeyboardInterrupt:
        print("specvox captions: interrupted; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ModelNotFoundError as e:
        print(f"specvox captions: {e}", file=sys.stderr)
        return EXIT_FAILED
    except MediaTooLong as e:
        return _refuse(f"{e} (--max-duration-s; 0: no limit)")
    except MediaError as e:
        return _refuse(str(e))
    document = result.document(fmt)
    try:
        _write(document, args.out)
    except OSError as e:
        print(f"specvox captions: cannot write {args.out}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if not args.quiet:
        _summary(result, args.out, fmt, "the transcripts verbatim" if cleaner is None else
                 f"cleaned by the LLM in {cleaner.generator.loaded.weights} weights")
    return EXIT_OK


def caption_cleaner(settings, name: str, weights: str | None = None):
    """The cleaner `--cleaner` names: the LLM's (`CaptionCleaner`, the configured llm model, in the weight
    form `--weights` names or `file_cleaning_options` picks) or None (the identity: each caption its transcript)."""
    if name == "identity":
        return None
    from pipeline.llm.caption_cleaner import CaptionCleaner, file_cleaning_options
    from pipeline.llm.engine import Generator
    from pipeline.llm.model import load_model

    llm = replace(settings.llm, weights=weights) if weights else file_cleaning_options(settings.llm)
    return CaptionCleaner(Generator(load_model(llm)))


def describe(info) -> str:
    from pipeline.media import describe_duration

    length = describe_duration(info.duration_s) if info.duration_s is not None else "length unknown"
    return f"{info.path}: {info.codec} audio, {length}"


def _refuse(message: str) -> int:
    print(f"specvox captions: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _write(document: str, out: str) -> None:
    """To stdout, or to `out` whole or not at all (a temporary file beside it, renamed)."""
    if not out:
        sys.stdout.write(document)
        sys.stdout.flush()
        return
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".captions-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(document)
        os.replace(temporary, out)
    except BaseException:
        os.unlink(temporary)
        raise


def _summary(result, out: str, fmt: str, cleaning: str) -> None:
    t = result.timings
    speed = result.duration_s / t.total_s if t.total_s else 0.0
    words = sum(len(u.caption_words) for u in result.utterances)
    where = out or "standard output"
    print(f"specvox captions: {result.duration_s:.1f} s of audio in {t.total_s:.1f} s ({speed:.1f}x real time): "
          f"{_count(len(result.utterances), 'utterance')}, {_count(words, 'word')}, {_count(len(result.cues), 'cue')} "
          f"({cleaning}); {fmt} to {where}",
          file=sys.stderr)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class _ProgressBar:
    """tqdm on stderr in seconds of audio captioned (its rate: times real time), with an ETA where the
    file states its length."""

    def __init__(self, total_s: float | None, disabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=round(total_s, 1) if total_s else None, unit="s", unit_scale=False, file=sys.stderr,
                         disable=disabled, desc="captions", dynamic_ncols=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of audio "
                                    "[{elapsed}<{remaining}, {rate_fmt}]" if total_s else None)
        self._done = 0.0

    def update(self, done_s: float) -> None:
        step = round(done_s, 1) - self._done
        if step > 0:
            self._bar.update(step)
            self._done += step

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()


COMMANDS = (Command("captions", "a media file's timed captions (WebVTT, SRT, JSON), in this process",
                    captions_arguments, run_captions, log_level="WARNING"),)
