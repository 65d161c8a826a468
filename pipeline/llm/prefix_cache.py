"""Each session's KV cache kept between turns, so that a turn prefills only what is new.

A dialogue prompt is the previous turn's prompt, its reply and the new user message: most
of it was in the target's KV cache when the previous reply ended. `PrefixCache` keeps, per
session, the token sequence a cache holds and the cache itself (one row: the lean pass's preallocated
`kv_cache.KVCache`, or transformers' `DynamicCache` where the target runs through its
modules). A new request takes the longest common prefix of its prompt with that
sequence, rolls the cache back to it (`model.rollback`, the crop that drops a rejected
draft's tail) and prefills only the rest. Nothing needs invalidating: a history that
changed (a reply the user cut off is recorded shorter, a preemptive turn was dropped)
differs from the cached tokens past the change, and only what comes before it is reused.

Numerics. Keys and values computed in several passes (the last prompt's prefill, the
reply's verification passes, this suffix's prefill) are not bit for bit those of one
prefill over the whole prompt: attention and products round differently for other pass
shapes (on the bundled target in float32 the next-token logits moved by up to 6e-5).
So a reply decoded on a cached prefix is lossless relative to plain decoding from the
same cache state (speculative decoding equals it token for token), and equals the
uncached reply wherever that rounding does not decide a token: in float32 it has not in
the tests; in 16-bit configurations rounding of that size can. `llm.prefix_cache_sessions=0`
makes every reply a function of its prompt alone.

A session may keep more than one prefix: a key `variant_key(session, name)` is that session's
too (the end-of-turn score keeps the user's words lower-cased beside the reply's as written).
`take(key, prompt, fallback=...)` starts from a copy of the session's other prefix where it
shares more, and the bound counts sessions: one dropped drops all of its prefixes.

Memory: a cached token costs 2 · layers · kv_heads · head_dim values (46 KB for the bundled
target in float32: 1,000 tokens ≈ 46 MB, plus a `KVCache`'s spare slots, under
`kv_cache.CHUNK_TOKENS`). Two bounds hold, least recently used sessions dropped first: the
sessions kept (`llm.prefix_cache_sessions`) and the bytes their buffers hold
(`llm.prefix_cache_mb`, counted as allocated, spare slots included). A session count alone let
the memory follow the conversations' lengths; the byte bound makes the cache's share of the
process flat by construction. The entry just put is never dropped, so one prompt longer than the
byte bound is still kept (alone). `take` and `put` run on the model's thread; `reusable` only
reads, from any.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.llm.model import rollback


@dataclass
class CachedPrefix:
    tokens: tuple[int, ...]  # what the cache holds, position by position
    cache: Any  # KVCache or DynamicCache holding len(tokens) positions, one row
    nbytes: int = 0  # what its buffers hold, as allocated (`cache_nbytes`)


def cache_nbytes(cache: Any) -> int:
    """The bytes a KV cache's tensors hold, as allocated: a `KVCache`'s spare slots count, and
    views of one buffer count it once."""
    tensors = [cache.keys, cache.values] if isinstance(getattr(cache, "keys", None), torch.Tensor) else [
        t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


VARIANT_SEPARATOR = "\x00"


def variant_key(session_key: str, name: str) -> str:
    """The key of another prefix of `session_key`'s, kept and dropped with the session."""
    return f"{session_key}{VARIANT_SEPARATOR}{name}"


def _session_of(key: str) -> str:
    return key.split(VARIANT_SEPARATOR, 1)[0]


class PrefixCache:
    """Up to `sessions` sessions' caches holding at most `max_bytes` together, least recently
    used dropped; `sessions` 0 keeps none, `max_bytes` 0 counts no bytes."""

    def __init__(self, sessions: int = 8, max_bytes: int = 0) -> None:
        if sessions < 0:
            raise ValueError("prefix_cache_sessions must be 0 (off) or more")
        if max_bytes < 0:
            raise ValueError("prefix_cache_mb must be 0 (no bound in bytes) or more")
        self.sessions = sessions
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CachedPrefix] = OrderedDict()

    @property
    def nbytes(self) -> int:
        """The bytes the kept caches hold now."""
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def reusable(self, key: str, prompt: Sequence[int]) -> int:
        """Prompt tokens `take` would find cached for `key` now (a read: safe from another thread)."""
        entry = self._entries.get(key) if key else None
        return 0 if entry is None else _reusable(entry.tokens, prompt)

    def tokens(self, key: str) -> tuple[int, ...]:
        """What is cached for `key` (a read: safe from another thread)."""
        entry = self._entries.get(key) if key else None
        return () if entry is None else entry.tokens

    def take(self, key: str, prompt: Sequence[int], fallback: str = "") -> tuple[Any, int]:
        """(the cache rolled back to the common prefix, its length), or (None, 0).

        The entry leaves the store: the request owns the cache now and `put`s back its own.
        At most len(prompt) − 1 tokens are reused: the prompt's last token is the first
        verification pass's input (the engine's invariant: the cache holds all but the last).
        `fallback`: another key whose entry is copied (and left in the store) where it shares more.
        """
        entry = self._entries.pop(key, None) if key else None
        keep = 0 if entry is None else _reusable(entry.tokens, prompt)
        other = self._entries.get(fallback) if fallback else None
        if other is not None and (shared := _reusable(other.tokens, prompt)) > keep:
            entry, keep = CachedPrefix(other.tokens, copy.deepcopy(other.cache), other.nbytes), shared
        if entry is None or keep == 0:
            return None, 0
        rollback(entry.cache, keep)
        return entry.cache, keep

    def put(self, key: str, tokens: Sequence[int], cache: Any) -> None:
        """Keep `cache`, which holds `tokens`, as `key`'s (the most recently used)."""
        if not self.sessions or not key or not tokens or cache is None:
            return
        held = cache.get_seq_length()
        if held != len(tokens):
            raise ValueError(f"a cache of {held} positions cannot stand for {len(tokens)} tokens")
        if getattr(cache, "borrowed", False):  # lent by the CUDA graphs for one reply: kept in its own
            cache.move_to_own()
        self._entries.pop(key, None)
        self._entries[key] = CachedPrefix(tuple(tokens), cache, cache_nbytes(cache))
        while len({_session_of(k) for k in self._entries}) > self.sessions:
            oldest = _session_of(next(iter(self._entries)))
            for k in [k for k in self._entries if _session_of(k) == oldest]:
                del self._entries[k]
        if self.max_bytes:
            self._shed_bytes(keep=key)

    def _shed_bytes(self, keep: str) -> None:
        """Drop least recently used sessions (all their prefixes), then `keep`'s other prefixes,
        until the kept bytes fit `max_bytes`; `keep` itself stays."""
        total = self.nbytes
        for session in dict.fromkeys(_session_of(k) for k in self._entries if _session_of(k) != _session_of(keep)):
            if total <= self.max_bytes:
                return
            for k in [k for k in self._entries if _session_of(k) == session]:
                total -= self._entries.pop(k).nbytes
        for k in [k for k in self._entries if k != keep]:
            if total <= self.max_bytes:
                return
            total -= self._entries.pop(k).nbytes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _reusable(cached: Sequence[int], prompt: Sequence[int]) -> int:
    return min(common_prefix(cached, prompt), len(prompt) - 1)
