"""Drafters: cheap guesses of the target's next tokens, verified by the target in one pass.

Every drafter answers `propose(context, k)` with up to k tokens and, when it has one,
the distribution q it drew them from; a drafter without one is a point mass (see
pipeline/llm/sampling.py). The context is the whole sequence so far: prompt,
then the tokens committed by earlier steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipeline.llm.model import rollback
from pipeline.llm.sampling import SamplingOptions, logits_to_probs, sample


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    q: torch.Tensor | None = None  # [len(tokens), V] when the drafter has a distribution
    match: int = 0  # model-free drafters: length of the matched suffix, their confidence


EMPTY = Draft(())


class Drafter(Protocol):
    name: str
    model_free: bool  # True: drafting costs next to nothing beside a target pass

    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    def commit(self, context: Sequence[int]) -> None:
        """The reply is over: `context` is everything that was said (drafters may learn)."""


class NoDrafter:
    """Plain decoding through the speculative code path: every step verifies nothing."""

    name = "none"
    model_free = True

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return EMPTY

    def commit(self, context: Sequence[int]) -> None:
        pass


class PromptLookupDrafter:
    """n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"): find the latest earlier
    occurrence of the context's last n tokens (n from `max_ngram` down to `min_ngram`) and
    propose what followed it. Works because replies quote their prompt and history."""

    name = "ngram"
    model_free = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int) -> Draft:
        tokens = list(context)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return Draft(tuple(follow), match=n)
        return EMPTY

    def commit(self, context: Sequence[int]) -> None:
        pass


class SuffixAutomaton:
    """Online suffix automaton (Blumer et al. 1985) over token ids.

    Each state is a set of substrings ending at the same positions; `first_end[s]` is
    where its first occurrence ends, so a match's continuation can be read from `text`.
    """

    def __init__(self) -> None:
        self.text: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first_end: list[int] = [-1]
        self.last = 0

    def extend(self, token: int) -> None:
        self.text.append(token)
        cur = self._new_state(self.length[self.last] + 1, len(self.text) - 1)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(self.length[p] + 1, self.first_end[q])
                self.next[clone] = dict(self.next[q])
                self.link[clone] = self.link[q]
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def longest_suffix_match(self, context: Sequence[int]) -> tuple[int, int]:
        """(matched length, end position in `text`) of the longest suffix of context found."""
        state, matched = 0, 0
        for token in context:
            while state and token not in self.next[state]:
                state = self.link[state]
                matched = self.length[state]
            if token in self.next[state]:
                state, matched = self.next[state][token], matched + 1
        return matched, self.first_end[state] if matched else -1

    def _new_state(self, length: int, first_end: int) -> int:
        self.next.append({})
        self.link.append(-1)
        self.length.append(length)
        self.first_end.append(first_end)
        return len(self.length) - 1


class SuffixDrafter:
    """Proposes the continuation of the longest suffix of the context seen before, in this
    session's past (everything said so far, replies included) or earlier in this reply;
    of the two, the longer match wins (the current sequence on a tie: it is more recent)."""

    name = "suffix"
    model_free = True

    def __init__(self, min_match: int = 1, max_context: int = 64) -> None:
        self.min_match, self.max_context = min_match, max_context
        self.memory = SuffixAutomaton()  # the session's past
        self._lookup = PromptLookupDrafter(max_ngram=8, min_ngram=min_match)
        self._separator = -1  # never a token id: matches never run across two utterances

    def propose(self, context: Sequence[int], k: int) -> Draft:
        local = self._lookup.propose(context, k)
        matched, end = self.memory.longest_suffix_match(context[-self.max_context :])
        if matched >= self.min_match and matched > local.match:
            remembered = self._follow(self.memory.text, end, k)
            if remembered:
                return Draft(remembered, match=matched)
        return local

    def commit(self, context: Sequence[int]) -> None:
        for token in context:
            self.memory.extend(token)
        self.memory.extend(self._separator)

    @staticmethod
    def _follow(text: list[int], end: int, k: int) -> tuple[int, ...]:
        follow = []
        for token in text[end + 1 : end + 1 + k]:
            if token < 0:
                break
            follow.append(token)
        return tuple(follow)


class ModelDrafter:
    """A smaller causal LM sharing the target's tokenizer; keeps its own KV cache and
    rolls it back to what the target committed (only its common prefix is kept)."""

    model_free = False

    def __init__(self, model: Callable[..., Any], device: torch.device, sampling: SamplingOptions,
                 generator: torch.Generator | None = None, name: str = "draft") -> None:
        self.model, self.device, self.sampling, self.generator = model, device, sampling, generator
        self.name = name
        self._cache = None
        self._cached: list[int] = []  # the tokens whose keys and values are in the cache

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        logits = self._catch_up(list(context))
        tokens, rows = [], []
        for i in range(k):
            if self.sampling.greedy:
                token = int(torch.argmax(logits))
            else:
                probs = logits_to_probs(logits[None], self.sampling)[0]
                rows.append(probs)
                token = sample(probs, self.generator)
            tokens.append(token)
            if i + 1 < k:
                logits = self._forward([token])
        return Draft(tuple(tokens), torch.stack(rows) if rows else None)

    def commit(self, context: Sequence[int]) -> None:
        self._cache, self._cached = None, []

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        common = 0
        limit = min(len(context) - 1, len(self._cached))  # always re-run at least the last token
        while common < limit and self._cached[common] == context[common]:
            common += 1
        if self._cache is not None:
            rollback(self._cache, common)
        self._cached = self._cached[:common]
        return self._forward(context[common:])

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([tokens], device=self.device), cache=self._cache,
                         use_cache=True, logits_to_keep=1)
        self._cache = out.cache
        self._cached.extend(tokens)
        logits = out.logits[0, -1]
        # a 16-bit drafter's distribution is computed in float32, so q sums to 1 as the sampling rule needs
        return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
