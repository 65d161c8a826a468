"""espeak-ng's clause phonemes without piper's bridge leaking them.

piper-tts 1.8.0's bridge to espeak-ng (the newest release) leaks twice on every phonemization, a
call for every phrase the tts speaks (and for each word it times), so the tts's memory rose with
every turn (docs/reliability.md, "Soak"):
- `espeakbridge.get_phonemes` never frees the Python objects it returns: 0.7 KB a three-clause
  phrase. The bridge's module also exports espeak-ng's own `espeak_TextToPhonemesWithTerminator`:
  `clause_phonemes` calls it through ctypes on the same, already initialised library and builds
  the bridge's result, (phonemes, terminator, end of sentence) per clause, with nothing kept.
- `espeakbridge.set_voice`, which piper's phonemizer calls before every text, makes espeak-ng copy
  the voice (1,360 bytes) into its synthesis command queue (`DoVoiceChange`), freed only when audio
  is synthesized from the queue; piper only phonemizes, so every copy was lost. `set_voice_once`
  sets a voice only where espeak-ng holds another (the workaround echogarden's authors found for
  the same leak, echogarden-project/echogarden#64).
`use_for_piper` puts both in the bridge's place, so piper's phonemizer, unchanged otherwise, uses them.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

ESPEAK_CHARS_AUTO = 0
IPA_PHONEMES = 0x02
# A clause's terminator as espeak-ng reports it (translate.h): a pause length, an intonation and a
# clause type, in the low 20 bits; higher bits are flags that do not change the punctuation.
CLAUSE_BITS = 0x000FFFFF
CLAUSE_TYPE_SENTENCE = 0x00080000
TERMINATORS = {
    40 | 0x00000 | 0x80000: ".",
    20 | 0x01000 | 0x40000: ",",
    40 | 0x02000 | 0x80000: "?",
    45 | 0x03000 | 0x80000: "!",
    30 | 0x00000 | 0x40000: ":",
    30 | 0x01000 | 0x40000: ";",
}


@functools.cache
def _text_to_phonemes() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    from piper import espeakbridge

    # PyDLL: the call holds the GIL as the bridge's did, since espeak-ng's state is not thread-safe.
    function = ctypes.PyDLL(espeakbridge.__file__).espeak_TextToPhonemesWithTerminator
    function.restype = ctypes.c_char_p
    function.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    return function


def clause_phonemes(text: str) -> list[tuple[str, str, bool]]:
    """`espeakbridge.get_phonemes(text)`: each clause's IPA phonemes, its terminator ("." "," "?" "!"
    ":" ";" or "") and whether it ends a sentence; espeak-ng initialised and its voice set."""
    text_to_phonemes = _text_to_phonemes()
    buffer = ctypes.create_string_buffer(text.encode("utf-8"))
    cursor = ctypes.c_void_p(ctypes.addressof(buffer))  # espeak-ng moves it past each clause, to NULL
    clauses = []
    while cursor.value:
        terminator = ctypes.c_int(0)
        phonemes = text_to_phonemes(ctypes.byref(cursor), ESPEAK_CHARS_AUTO, IPA_PHONEMES, ctypes.byref(terminator))
        kind = terminator.value & CLAUSE_BITS
        clauses.append(((phonemes or b"").decode("utf-8"), TERMINATORS.get(kind, ""),
                        kind & CLAUSE_TYPE_SENTENCE == CLAUSE_TYPE_SENTENCE))
    return clauses


_voice_set: str | None = None  # the voice espeak-ng holds, set through set_voice_once


def set_voice_once(voice: str) -> None:
    """`espeakbridge.set_voice(voice)` where espeak-ng holds another voice, and nothing where it
    holds this one: each setting leaks a copy of the voice (see the module's docstring)."""
    global _voice_set
    if voice != _voice_set:
        _voice_set = None  # unknown until the bridge has set it (it raises for an unknown voice)
        assert bridge_set_voice is not None, "use_for_piper() first"
        bridge_set_voice(voice)
        _voice_set = voice


def _initialize(data_dir: str) -> None:
    """`espeakbridge.initialize`, after which espeak-ng holds no voice set here."""
    global _voice_set
    _voice_set = None
    assert bridge_initialize is not None
    bridge_initialize(data_dir)


# The bridge's functions replaced (tests/e2e/test_tts.py compares with them and measures their leaks).
bridge_get_phonemes: Callable[[str], list[tuple[str, str, bool]]] | None = None
bridge_set_voice: Callable[[str], None] | None = None
bridge_initialize: Callable[[str], None] | None = None


def use_for_piper() -> None:
    """Piper's phonemizer calls `clause_phonemes` and `set_voice_once` where it called the bridge's
    leaking functions."""
    global bridge_get_phonemes, bridge_set_voice, bridge_initialize
    from piper import espeakbridge

    if espeakbridge.get_phonemes is not clause_phonemes:
        bridge_get_phonemes, bridge_set_voice, bridge_initialize = (
            espeakbridge.get_phonemes, espeakbridge.set_voice, espeakbridge.initialize)
        espeakbridge.get_phonemes, espeakbridge.set_voice, espeakbridge.initialize = (
            clause_phonemes, set_voice_once, _initialize)
