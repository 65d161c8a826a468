"""espeak-ng's clause phonemes without piper's bridge leaking them.

piper-tts 1.8.0's `espeakbridge.get_phonemes` (the newest release) never frees what it returns:
0.7 KB of Python objects a call for a three-clause phrase, a call for every phrase the tts speaks
(and for each word it times), so the tts's memory rose with every turn (docs/reliability.md,
"Soak"). The bridge's module also exports espeak-ng's own `espeak_TextToPhonemesWithTerminator`:
`clause_phonemes` calls it through ctypes on the same, already initialised library and builds the
bridge's result, (phonemes, terminator, end of sentence) per clause, with nothing kept.
`use_for_piper` puts it in the bridge's place, so piper's phonemizer, unchanged otherwise, uses it.
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


bridge_get_phonemes: Callable[[str], list[tuple[str, str, bool]]] | None = None  # the one replaced


def use_for_piper() -> None:
    """Piper's phonemizer calls `clause_phonemes` where it called the bridge's leaking function
    (kept as `bridge_get_phonemes`, which tests/test_tts.py compares with)."""
    global bridge_get_phonemes
    from piper import espeakbridge

    if espeakbridge.get_phonemes is not clause_phonemes:
        bridge_get_phonemes = espeakbridge.get_phonemes
        espeakbridge.get_phonemes = clause_phonemes
