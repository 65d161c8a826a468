"""Which words of a whisper pass the speaker said.

A pass over an utterance gives words, and whisper's measures of the pass as a whole (`Transcript`).
Not all of the words were said:

- whisper goes on into the silence after the speech (`spoken_words`): words begun after the VAD's
  end of speech, unsure ones just before it, and the utterance once more, crammed into its end;
- it loops (`without_loop`): "and anthem. and anthem. and and anthem.";
- and a sound that is no word (a hum, "mm-hmm") is written as words (`heard_as_words`):
  "in a moment", "and anthem", or a hum's spelling ("Mm-hmm", "MMMM").

`utterance_words` puts the three together: the words an utterance's final says. The streaming
recognizer's finals and a transcription of the utterance's audio (after the speech before it that
the final went on from) both go through it, so the two say the same words
(tests/e2e/test_asr_stream.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from pipeline.asr import AsrOptions, Transcript, Utterance, Word, crammed_copy_of_last, norm_word, voiced_briefly

# Whisper's spellings of a hum: "Mm-hmm", "MMMM", "mhm", "Hmm", "M-M-M": each hyphen-separated
# piece of letters m, n and h alone (as pipeline/turn_taking.MURMUR reads a final's words).
HUM = re.compile(r"[mnh]+")


def utterance_words(transcript: Transcript, utterance: Utterance, options: AsrOptions,
                    ended: bool = True) -> tuple[Word, ...]:
    """The words of an utterance's final, from a pass over its audio whole: less whisper's additions
    to the silence after the speech, less a loop's copies, and none when the pass heard no word.
    `ended` False: a partial pass while the user speaks (the words at the audio's edge stay)."""
    words = spoken_words(transcript.words, utterance, ended, options.tail_min_probability,
                         options.tail_keep_inside_ms / 1000)
    words = without_loop(words, options.loop_min_copies)
    return words if heard_as_words(transcript, words, utterance, options) else ()


def heard_as_words(transcript: Transcript, words: Sequence[Word], utterance: Utterance, options: AsrOptions) -> bool:
    """Whether the pass heard words, not a sound that is none (`words`: the pass's, as kept).

    Whisper tiny writes a hum as words it is unsure of ("in a moment.", "and anthem", "Then...") or
    as a hum's spelling. Neither its no-speech probability nor its log probability alone tells
    them from a short real word ("Hello?" at no-speech 0.49 and -1.04, a hum's "Then..." at 0.48
    and -1.07); together, on an utterance voiced for less than `short_utterance_ms`, they reject
    the surest cases, and a hum's spelling among its words tells the rest. Any utterance whose
    words are all a hum's spelling is a hum.
    """
    if not words:
        return False
    pieces = [p for w in words for p in w.text.replace("-", " ").split() if norm_word(p)]
    hums = [bool(HUM.fullmatch(norm_word(p))) for p in pieces]
    if all(hums):
        return False
    if not voiced_briefly(utterance, options):
        return True
    unsure = (transcript.no_speech_prob >= options.short_no_speech_probability
              and transcript.avg_logprob < options.short_avg_logprob)
    return not unsure and not any(hums)


def without_loop(words: Sequence[Word], min_copies: int) -> tuple[Word, ...]:
    """`words` less all but the first of `min_copies` or more copies in a row of the same words at
    their end (as `norm_word` compares them); unchanged where there are fewer (0 or 1: off)."""
    said = [norm_word(w.text) for w in words]
    for k in range(1, len(said) // max(min_copies, 2) + 1):
        copies, at = 1, len(said) - k
        while at >= k and said[at - k : at] == said[-k:]:
            copies, at = copies + 1, at - k
        if min_copies >= 2 and copies >= min_copies:
            return tuple(words[: at + k])
    return tuple(words)


def spoken_words(words: Sequence[Word], utterance: Utterance, ended: bool = False,
                 tail_min_probability: float = 0.0, tail_inside_s: float = math.inf) -> tuple[Word, ...]:
    """The words that begin before the VAD's end of speech; once the speech has `ended`, less
    the trailing words with no duration, and those whisper gave a probability below
    `tail_min_probability` that begin less than `tail_inside_s` before the end of speech.

    Whisper, given the silence after an utterance, often goes on with words of its own
    ("I'm going to go ahead and", "Thank you.", "and and"): timed at or after the end of the
    speech (Silero's end already runs ~50 ms past the real one), just before it with a low
    probability (0.1-0.5 where the spoken words of the same passes had 0.8-1.0), or as the
    utterance once more, every word aligned to the same instant at the end of the speech.
    A real last word that whisper tiny is unsure of ("Why do cats [purr]?" at 0.10-0.21 on
    four voices) lies well inside the speech: it began 0.2-0.4 s before the VAD's end.
    The utterance once more is not always all at one instant: its last word may be given the
    frames left ("what about? what[8.236-8.236] about?[8.236-8.256]"), so a trailing copy of the
    words just before it with a word of no duration goes as a whole (`_repeated_tail`).
    """
    spoken = [w for w in words if w.start_s < utterance.speech_end_s]

    def added(w: Word) -> bool:
        unsure = w.probability < tail_min_probability and utterance.speech_end_s - w.start_s < tail_inside_s
        return unsure or w.end_s <= w.start_s

    while ended and spoken:
        if added(spoken[-1]):
            spoken.pop()
        elif repeated := _repeated_tail(spoken):
            del spoken[-repeated:]
        else:
            break
    return tuple(spoken)


def _repeated_tail(words: Sequence[Word]) -> int:
    """How many trailing words are whisper's copy of the words just before them (`crammed_copy_of_last`); 0: none."""
    for k in range(1, len(words)):
        if crammed_copy_of_last(words[-k:], words[:-k]):
            return k
    return 0
