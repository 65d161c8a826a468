"""Incremental detokenization: text deltas that never split a character."""

from __future__ import annotations

from collections.abc import Sequence

INCOMPLETE = "\ufffd"  # how the decoder shows the bytes of a character that has not ended yet


class IncrementalDetokenizer:
    """Decodes the whole reply each time and emits only what is new and complete.

    A byte-level BPE token can end mid-way through a UTF-8 character; the decoder
    shows that as U+FFFD, so such a tail is held back until the next token completes it.
    What has been emitted after n tokens is a function of those n tokens alone (their text
    without an unfinished tail), not of how they were pushed, so a detokenizer `primed` with
    a reply's first n tokens (a reply resumed from its log) emits from there exactly what
    the uninterrupted one emits, a character split across the cut included.
    """

    def __init__(self, tokenizer: object, primed: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(primed)
        self.text = self._complete() if self._ids else ""  # everything emitted so far

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._complete()
        delta, self.text = text[len(self.text) :], text
        return delta

    def _complete(self) -> str:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        return text.rstrip(INCOMPLETE)
