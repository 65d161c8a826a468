"""Incremental detokenization: text deltas that never split a character."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes the whole reply each time and emits only what is new and complete.

    A byte-level BPE token can end mid-way through a UTF-8 character; the decoder
    shows that as U+FFFD, so such a tail is held back until the next token completes it.
    """

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        if text.endswith("\ufffd"):
            return ""
        delta, self._emitted = text[self._emitted :], len(text)
        return delta
