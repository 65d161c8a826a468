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

from pipeline.llm.cuda_graph_step import Stopwatch
from pipeline.llm.lean_llama import LeanLlama
from pipeline.llm.model import rollback
from pipeline.llm.options import SamplingOptions
from pipeline.llm.sampling import RandomSource, generator_at, greedy_tokens, logits_to_probs, sample


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    q: torch.Tensor | None = None  # [len(tokens), V] when the drafter has a distribution
    match: int = 0  # model-free drafters: length of the matched suffix, their confidence
    # other continuations a model-free drafter found, by preference, for a token tree (token_tree.py)
    branches: tuple[tuple[int, ...], ...] = ()


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

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, branches: int = 0) -> None:
        """`branches`: besides the draft, up to this many other continuations (of other occurrences
        of the same n-gram, then of shorter ones), for a token tree."""
        self.max_ngram, self.min_ngram, self.branches = max_ngram, min_ngram, branches

    def propose(self, context: Sequence[int], k: int) -> Draft:
        tokens = list(context)
        found: list[tuple[int, ...]] = []
        match = 0
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first
                if tokens[start : start + n] == tail:
                    follow = _copied(tokens, start + n, k)
                    if follow and follow not in found:
                        match = match or n
                        found.append(follow)
                        if len(found) > self.branches:
                            return Draft(found[0], match=match, branches=tuple(found[1:]))
        return Draft(found[0], match=match, branches=tuple(found[1:])) if found else EMPTY

    def commit(self, context: Sequence[int]) -> None:
        pass


def _copied(tokens: list[int], begin: int, k: int) -> tuple[int, ...]:
    """k tokens read on from `begin`, and past the context's end on into themselves, as LZ77 copies
    overlapping a match: the context ends with what stood `len(tokens) - begin` tokens back, so
    the guess is that it goes on repeating. A reply caught in a loop ("of the team of the team
    ...", a small model's greedy failure) is then drafted k tokens at a time, not one period."""
    period = len(tokens) - begin
    return tuple(tokens[begin + j % period] for j in range(k))


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


# A session's suffix memory at most, in tokens: the automaton takes ~450 bytes a token, so ~2 MB
# a session; all sessions' together are bounded by engine.REMEMBERED_TOKENS (~30 MB).
MEMORY_TOKENS = 4096


class SuffixDrafter:
    """Proposes the continuation of the longest suffix of the context seen before, in this
    session's past (everything said so far, replies included) or earlier in this reply;
    of the two, the longer match wins (the current sequence on a tie: it is more recent)."""

    name = "suffix"
    model_free = True

    def __init__(self, min_match: int = 1, max_context: int = 64, max_memory_tokens: int = MEMORY_TOKENS,
                 branches: int = 0) -> None:
        self.min_match, self.max_context, self.max_memory_tokens = min_match, max_context, max_memory_tokens
        self.memory = SuffixAutomaton()  # the session's past
        self._lookup = PromptLookupDrafter(max_ngram=8, min_ngram=min_match, branches=branches)
        self._separator = -1  # never a token id: matches never run across two utterances

    @property
    def branches(self) -> int:
        """Other continuations proposed beside the draft (from this reply's own n-grams), for a token tree."""
        return self._lookup.branches

    @branches.setter
    def branches(self, count: int) -> None:
        self._lookup.branches = count

    def propose(self, context: Sequence[int], k: int) -> Draft:
        local = self._lookup.propose(context, k)
        matched, end = self.memory.longest_suffix_match(context[-self.max_context :])
        if matched >= self.min_match and matched > local.match:
            remembered = self._follow(self.memory.text, end, k)
            if remembered:
                others = [b for b in (local.tokens, *local.branches) if b and b != remembered]
                return Draft(remembered, match=matched, branches=tuple(others[: self.branches]))
        return local

    def commit(self, context: Sequence[int]) -> None:
        if len(self.memory.text) + len(context) + 1 > self.max_memory_tokens:
            # Each request's context is the prompt with the conversation so far, so the memory
            # would grow by the whole history every turn; starting over from the latest context
            # keeps what the prompt shows and bounds a long session's memory.
            self.memory = SuffixAutomaton()
            context = context[-(self.max_memory_tokens - 1):]
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
    rolls it back to what the target committed (only its common prefix is kept).

    `generator` draws the sampled draft tokens: one generator, or a callable giving the
    generator for the draft token at a context index (seeded sampling's per-position state).
    `prompt_tokens`: the request's prompt length. The first catch-up of a resumed reply runs
    the prompt in one pass, as the uninterrupted reply's first draft did, and the reply's
    tokens after it. `exact_rows`: a catch-up over several reply tokens computes each row as a
    one-token pass would (`LeanLlama`'s `rows_alone`, in passes of `exact_rows` tokens; other
    models in passes of that many tokens), so that seeded sampling's q at a position does not
    depend on how the catch-ups fell; 0: one pass, however it rounds (greedy output does not
    depend on the draft's rounding).

    `steady_pass_s`: the mean time of the last `propose`'s passes over one or two new tokens
    (a draft token's price, which the draft-length model's c is made of), None when it ran
    none; a catch-up over more tokens costs more than a draft token and is left out of it.
    Passes are timed to their end on an asynchronous device (CUDA).
    """

    STEADY_TOKENS = 2  # a pass over this many new tokens or fewer is a draft step, not a catch-up

    model_free = False

    def __init__(self, model: Callable[..., Any], device: torch.device, sampling: SamplingOptions,
                 generator: RandomSource = None, name: str = "draft", prompt_tokens: int = 0,
                 exact_rows: int = 0) -> None:
        self.model, self.device, self.sampling, self.generator = model, device, sampling, generator
        self.name = name
        self.prompt_tokens, self.exact_rows = prompt_tokens, exact_rows
        self._cache = None
        self._cached: list[int] = []  # the tokens whose keys and values are in the cache
        self._steady: list[float] = []  # seconds of this propose's steady passes
        self.steady_pass_s: float | None = None

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._steady = []
        logits = self._catch_up(list(context))
        tokens, rows = [], []
        for i in range(k):
            if self.sampling.greedy:
                token = int(greedy_tokens(logits))
            else:
                probs = logits_to_probs(logits[None], self.sampling)[0]
                rows.append(probs)
                token = sample(probs, generator_at(self.generator, len(context) + i))
            tokens.append(token)
            if i + 1 < k:
                logits = self._forward([token])
        self.steady_pass_s = sum(self._steady) / len(self._steady) if self._steady else None
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
        prompt_rest = self.prompt_tokens - common
        if 0 < prompt_rest < len(context) - common:  # a resumed reply: the prompt first, in one pass
            self._forward(context[common : self.prompt_tokens])
            common = self.prompt_tokens
        return self._forward(context[common:], replay=common >= self.prompt_tokens)

    def _forward(self, tokens: list[int], replay: bool = False) -> torch.Tensor:
        if not (replay and self.exact_rows and len(tokens) > 1):
            return self._pass(tokens)
        for start in range(0, len(tokens), self.exact_rows):
            logits = self._pass(tokens[start : start + self.exact_rows], rows_alone=True)
        return logits

    def _pass(self, tokens: list[int], rows_alone: bool = False) -> torch.Tensor:
        extra = {"rows_alone": True} if rows_alone and isinstance(self.model, LeanLlama) else {}
        started = Stopwatch()
        out = self.model(input_ids=torch.tensor([tokens], device=self.device), cache=self._cache,
                         use_cache=True, logits_to_keep=1, **extra)
        if len(tokens) <= self.STEADY_TOKENS:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._steady.append(started.seconds)
        self._cache = out.cache
        self._cached.extend(tokens)
        logits = out.logits[0, -1]
        # a 16-bit drafter's distribution is computed in float32, so q sums to 1 as the sampling rule needs
        return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
