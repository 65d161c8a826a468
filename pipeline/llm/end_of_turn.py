"""Text end-of-turn scoring: how likely the user's message ends after what they have said so far.

The idea is LiveKit's turn detector (livekit/agents, `livekit-plugins-turn-detector`, a
SmolLM2-135M fine-tuned for it): format the conversation with the model's chat template,
cut the user's last message just before its end-of-turn token (`<|im_end|>` for SmolLM2),
and read the probability the model gives that token at the last position. A sentence cut
at a comma ("Hello, can you tell me") almost never ends a message; a whole question often
does. LiveKit keeps the last 6 messages, at most 128 tokens, and lower-cases the text and
strips its punctuation, because its model was trained on such text.

Here it is the stage's own instruct model as it is, not fine-tuned, and the text is what
whisper wrote. That changes what works (measured by `specvox bench end-of-turn` on both test
voices; docs/benchmarks/history.md):

- whisper punctuates at a pause ("Hello," or "Hello." where the user only took a breath), and
  the instruct model gives `<|im_end|>` after a full stop little weight anyway (it expects
  more sentences after one), so the text as written separates badly;
- `marks` strips the trailing punctuation and sums the ways the message can
  end there: P(end | text) + Σ_m P(m | text)·P(end | text + m) over m in ". ? !". A
  question whose "?" was dropped and a statement without its full stop then score as they
  would with it, while "Hello" (the model expects "Hello, ...") and "I want to" stay low.
  It costs two passes: the prompt once (its KV cache kept), then the three marks as one
  batched one-token step on that cache (~a decode step): for a 43-token prompt (the default
  persona and a short question) about 110-120 ms on 2 busy CPU cores in float32, against
  ~77 ms for one pass (`strip`). It separated closes at the end of a turn from closes at a
  pause best (AUC 0.89 on the Piper voice, 0.68 on espeak-ng, whose transcripts are poor).
- the default, `lower-marks`, is `marks` on LiveKit's normalisation (lower case, no
  punctuation): in three runs of the benchmark it cut off no turn at an in-sentence pause at
  0.01 where `marks` cut off one at 0.03, with fewer late ends (28 against 30 of 60 in the
  last) and a higher AUC (0.86 against 0.82). The reply's prompt keeps the user's case, so the
  two prefill the user's words apart; `prepare` does both while the user is still speaking
  (the gateway sends the words heard so far), and each keeps its own prefix.
- `raw` (the text as written), `strip` (trailing punctuation removed, one pass), `lower`
  (LiveKit's normalisation, one pass) and `unpunct-marks` (all punctuation removed, the
  case kept) are there for the benchmark.

The scorer is pure torch over `LoadedModel` (its lean pass where it has one): no server, no
thread of its own. The llm service runs it on its model thread, between decode steps.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.llm.model import LoadedModel
from pipeline.llm.prefix_cache import PrefixCache, common_prefix, variant_key
from pipeline.llm.prompts import DEFAULT_PERSONA, Exchange, Task, chat_messages

END_OF_TURN_TOKEN = "<|im_end|>"  # ChatML's end of a message (SmolLM2, Qwen, ...)
END_MARKS = (".", "?", "!")  # the marks a message may end with, folded into `marks`
NORMALISATIONS = ("marks", "raw", "strip", "lower", "lower-marks", "unpunct-marks")
DEFAULT_NORMALISATION = "lower-marks"
# The policy measured by `specvox bench end-of-turn` (docs/benchmarks/history.md): when an utterance closes,
# the turn is complete if the score is at least COMPLETE_THRESHOLD; otherwise wait up to
# INCOMPLETE_WAIT_MS more silence for the user to go on before ending it anyway. On 22 paused and
# 8 whole turns per voice (both voices): 0 of 50 pause closes cut off, 28 of 60 ends waited;
# 150 ms of silence alone cut off 44 of 50.
COMPLETE_THRESHOLD = 0.01
INCOMPLETE_WAIT_MS = 700
# History kept for the score, as LiveKit's detector does: the last few exchanges, at most this many tokens.
MAX_HISTORY_EXCHANGES = 3
MAX_HISTORY_TOKENS = 128
_TRAILING = re.compile(r"[\s,.;:!?\u2026\-\u2013\u2014\"']+$")  # punctuation whisper puts at a pause or end
_PUNCTUATION = re.compile(r"[^\w\s'-]")  # LiveKit's: all but letters, digits, spaces, apostrophes, hyphens


@dataclass(frozen=True)
class EndOfTurnResult:
    probability: float  # that the user's message ends after the text scored
    prompt_tokens: int  # tokens of the pass over the conversation
    compute_ms: float  # wall time of the tokenization and the model passes
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache (not prefilled)


@dataclass(frozen=True)
class Prepared:
    prompt_tokens: int  # the conversation's tokens cached now, the user's words among them if `words`; 0: none
    words: bool  # the user's words were prefilled (not where that would have dropped cached conversation)
    compute_ms: float


def normalise(text: str, normalisation: str = DEFAULT_NORMALISATION) -> str:
    """The user's text as the scorer reads it under `normalisation` (see the module docstring)."""
    text = " ".join(text.split())
    if normalisation == "raw":
        return text
    if normalisation in ("lower", "lower-marks"):
        return " ".join(_PUNCTUATION.sub(" ", text.lower()).split())
    if normalisation in ("strip", "marks"):
        return _TRAILING.sub("", text)
    if normalisation == "unpunct-marks":  # LiveKit's, keeping the case (and so the user's tokens, mostly)
        return " ".join(_PUNCTUATION.sub(" ", text).split())
    raise ValueError(f"unknown end-of-turn normalisation {normalisation!r}: choose one of {', '.join(NORMALISATIONS)}")


class EndOfTurnScorer:
    """P(the user's message ends here), from the chat model's own end-of-turn token."""

    def __init__(self, loaded: LoadedModel, normalisation: str = DEFAULT_NORMALISATION,
                 max_history_exchanges: int = MAX_HISTORY_EXCHANGES,
                 max_history_tokens: int = MAX_HISTORY_TOKENS) -> None:
        normalise("", normalisation)  # an unknown normalisation fails here, not at the first turn
        self.loaded = loaded
        self.normalisation = normalisation
        self.max_history_exchanges = max_history_exchanges
        self.max_history_tokens = max_history_tokens
        tokenizer: Any = loaded.tokenizer
        end_id = _single_token(tokenizer, END_OF_TURN_TOKEN)
        if end_id is None:
            raise ValueError(f"the model's tokenizer has no {END_OF_TURN_TOKEN} token: it is not a ChatML model")
        self.end_id: int = end_id
        marks = [_single_token(tokenizer, m) for m in END_MARKS]
        self.mark_ids = [m for m in marks if m is not None]
        self._specials = [t for t in tokenizer.all_special_tokens if t]

    def probability(self, user_text: str, persona: str = DEFAULT_PERSONA,
                    history: tuple[Exchange, ...] = ()) -> float:
        return self.score(user_text, persona, history).probability

    def score(self, user_text: str, persona: str = DEFAULT_PERSONA, history: tuple[Exchange, ...] = (),
              normalisation: str | None = None, prefix_cache: PrefixCache | None = None,
              session_key: str = "") -> EndOfTurnResult:
        """`prefix_cache`: the generator's cache of the session's conversation. The score then
        prefills only the user's words (those `prepare` has not) on a copy of it, and keeps them
        under `score_key(session_key)`; a session with no conversation cached gets it first, so
        that the reply that follows prefills only the user's words too."""
        started = time.perf_counter()
        mode = normalisation or self.normalisation
        ids = self.prompt_ids(normalise(self._clean(user_text), mode), persona, history)
        if prefix_cache is not None and session_key not in prefix_cache:
            self.prepare(persona, history, prefix_cache, session_key)
        with torch.inference_mode():
            logits, cache, cached = self._prefill(ids, prefix_cache, score_key(session_key), fallback=session_key)
            first = torch.log_softmax(logits[0], dim=-1)
            p = math.exp(float(first[self.end_id]))
            if mode.endswith("marks") and self.mark_ids:
                p += self._marks_probability(first, copy.deepcopy(cache) if prefix_cache is not None else cache)
        return EndOfTurnResult(min(p, 1.0), len(ids), (time.perf_counter() - started) * 1000, cached)

    def prepare(self, persona: str, history: tuple[Exchange, ...], prefix_cache: PrefixCache,
                session_key: str, user_text: str = "") -> Prepared:
        """Prefill the conversation up to where the user's words go into `prefix_cache`, so that the
        session's next score prefills only those words (a session's first score otherwise prefills
        its persona too: ~210 ms against ~100 in the live benchmark).

        `user_text`: the words heard so far while the user speaks. They are prefilled too, twice:
        as the reply's prompt has them (under `session_key`) and as the score reads them (under
        `score_key(session_key)`), so that when the turn ends the score and the reply prefill
        only the words said since (the prefix cache keeps what a later text shares). Not where
        that would drop cached conversation: the cache can hold a reply that `history` does not
        have yet (the user speaks while it plays, and the gateway records what was heard later)."""
        started = time.perf_counter()
        text = self._clean(user_text)
        conversation = self.prompt_ids("", persona, history)
        if not text.strip():
            with torch.inference_mode():
                self._prefill(conversation, prefix_cache, session_key)
            return Prepared(len(conversation), False, (time.perf_counter() - started) * 1000)
        if self._ahead_of(conversation, prefix_cache.tokens(session_key)):
            return Prepared(0, False, (time.perf_counter() - started) * 1000)
        ids = self.prompt_ids(text, persona, history)
        scored = self.prompt_ids(normalise(text, self.normalisation), persona, history)
        with torch.inference_mode():
            self._prefill(ids, prefix_cache, session_key)
            self._prefill(scored, prefix_cache, score_key(session_key), fallback=session_key)
        return Prepared(len(ids), True, (time.perf_counter() - started) * 1000)

    def _ahead_of(self, conversation: list[int], cached: Sequence[int]) -> bool:
        """Whether `cached` holds conversation that `conversation` lacks: it differs inside it, or
        has a whole message after it (where only the user's unfinished words may be)."""
        shared = common_prefix(cached, conversation)
        return shared < min(len(cached), len(conversation)) or self.end_id in cached[len(conversation):]

    def prompt_ids(self, text: str, persona: str, history: tuple[Exchange, ...]) -> list[int]:
        """The conversation in the chat template, cut just before the user's end-of-turn token;
        the newest exchanges of `history` that fit the scorer's limits."""
        history = history[-self.max_history_exchanges:] if self.max_history_exchanges > 0 else ()
        base = len(self._encode(text, persona, ()))
        for start in range(len(history) + 1):
            ids = self._encode(text, persona, history[start:])
            if len(ids) - base <= self.max_history_tokens:
                return ids
        return ids

    def _encode(self, text: str, persona: str, history: tuple[Exchange, ...]) -> list[int]:
        messages = chat_messages(Task.DIALOGUE, text, persona, history)
        encoded = self.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=False)  # type: ignore[attr-defined]
        ids = [int(i) for i in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]
        last = len(ids) - 1 - ids[::-1].index(self.end_id)  # the user's message ends there
        return ids[:last]

    def _prefill(self, ids: list[int], prefix_cache: PrefixCache | None, key: str,
                 fallback: str = "") -> tuple[torch.Tensor, Any, int]:
        """The last position's logits, the KV cache over `ids` and how much of it was cached; with
        `prefix_cache`, on the prefix cached for `key` (or a copy of `fallback`'s where it shares
        more), and the cache over `ids` is left there for `key`."""
        cache, reused = prefix_cache.take(key, ids, fallback) if prefix_cache is not None else (None, 0)
        logits, cache = self._forward(torch.tensor([ids[reused:]], device=self.loaded.device), cache)
        if prefix_cache is not None:
            prefix_cache.put(key, ids, cache)
        return logits, cache, reused

    def _marks_probability(self, first: torch.Tensor, cache: Any) -> float:
        """Σ_m P(m | text)·P(end | text + m): the marks as one batched one-token step on the prompt's cache."""
        marks = self.mark_ids
        cache.batch_repeat_interleave(len(marks))
        logits, _ = self._forward(torch.tensor([[m] for m in marks], device=self.loaded.device), cache)
        after = torch.log_softmax(logits, dim=-1)[:, self.end_id]
        return float(torch.exp(first[marks] + after).sum())

    def _forward(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits (float32 at least) of the last position of each row [B, V], and the grown KV cache."""
        forward: Any = self.loaded.lean or self.loaded.model  # both take transformers 5's call signature
        out = forward(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        return (logits if logits.dtype == torch.float64 else logits.float()), out.cache

    def _clean(self, text: str) -> str:
        """The text without the tokenizer's special tokens (a transcript must not end the message itself)."""
        for special in self._specials:
            text = text.replace(special, " ")
        return text


def score_key(session_key: str) -> str:
    """Where the score keeps its prefix: the user's words as it reads them (`lower-marks`: lower
    case) differ from the reply's, so each keeps its own beside the other."""
    return variant_key(session_key, "end-of-turn")


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of `text` as one token of the vocabulary, or None."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return token_id
