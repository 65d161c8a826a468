"""Decoding as a sequence of verified steps: speculative decoding with any drafter.

A step drafts γ tokens, verifies them in one target forward pass over [last, x_1..x_γ],
keeps the accepted prefix plus one token of the target's own (recovered or bonus, see
pipeline/llm/sampling.py) and rolls the KV cache back over the rejected tail. With the
`none` drafter γ is 0 and a step is one plain decoding step, through the same code.
Consumers (the Redis token stream, the gRPC reply) see only steps of verified tokens.

Invariant of the loop: the target's cache holds every token of `context` but the last.
A request with a session key starts from that session's cached prefix where it has one
(pipeline/llm/prefix_cache.py) and leaves its own cache there when it ends.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.llm.budget import CostMeter
from pipeline.llm.detokenize import IncrementalDetokenizer
from pipeline.llm.draft_length import DraftLengthController, MatchAcceptance, VerifyCost
from pipeline.llm.drafters import (
    EMPTY,
    Drafter,
    ModelDrafter,
    NoDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
)
from pipeline.llm.lean_llama import LeanLlama
from pipeline.llm.model import (
    LlmOptions,
    LoadedModel,
    early_exit_model,
    load_draft_model,
    new_kv_cache,
    quantized_draft_applies,
    quantized_self_draft,
    rollback,
)
from pipeline.llm.prefix_cache import PrefixCache
from pipeline.llm.prompts import PromptTooLongError
from pipeline.llm.sampling import (
    SamplingOptions,
    apply_repetition_penalty,
    greedy_verify,
    logits_to_probs,
    speculative_verify,
)

MODEL_FREE_DRAFTERS = ("none", "ngram", "suffix")
EARLY_EXIT = "early-exit"
QUANTIZED = "quantized"  # the target's own weights at 4 bits (model.quantized_self_draft)
SESSIONS_REMEMBERED = 256  # suffix memories kept, least recently used dropped
SEEDED_DRAFT_COST = 0.25  # one draft step / one target step, assumed (not timed) for seeded sampling


@dataclass(frozen=True)
class DecodeStep:
    seq: int  # 0, 1, 2, … within the reply
    token_ids: tuple[int, ...]  # the tokens this step committed, in order
    text_delta: str
    finish_reason: str | None = None  # "eos", "length", "stop" or "cancelled" on the last step
    drafted: int = 0  # γ: tokens the drafter proposed for this step
    stats: GenerationStats | None = None  # on the last step
    prefix_cached_tokens: int = 0  # on the first step: prompt tokens whose keys and values were cached

    @property
    def accepted(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    drafter: str = "none"
    sampling: SamplingOptions = SamplingOptions()
    max_draft_tokens: int = 8
    adaptive_draft: bool = True
    stop_strings: tuple[str, ...] = ()
    session_key: str = ""  # lets the suffix drafter remember what this session said, and the prefix cache its KV


@dataclass
class GenerationStats:
    """Per request; `merge` aggregates requests."""

    steps: int = 0
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # by draft position
    accepted_at: list[int] = field(default_factory=list)
    target_s: float = 0.0
    draft_s: float = 0.0
    predicted_speedup_sum: float = 0.0
    prompt_tokens: int = 0
    prefix_cached_tokens: int = 0  # of the prompt, taken from the session's cache instead of prefilled
    prefill_s: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted_tokens += drafted
        self.accepted_draft_tokens += accepted
        grow = max(0, drafted - len(self.drafted_at))
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def mean_accepted_len(self) -> float:
        """Tokens committed per target pass (1.0 is plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_len": round(self.mean_accepted_len, 4),
            "acceptance_by_position": [round(a / d, 4) if d else None
                                       for a, d in zip(self.accepted_at, self.drafted_at, strict=True)],
            "target_s": round(self.target_s, 4),
            "draft_s": round(self.draft_s, 4),
            "draft_to_target_cost": round(self.draft_s / self.target_s, 4) if self.target_s else None,
            "predicted_speedup": round(self.predicted_speedup_sum / self.steps, 4) if self.steps else None,
            "prompt_tokens": self.prompt_tokens,
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "prefill_s": round(self.prefill_s, 4),
        }


class Generator:
    """Runs a request as decode steps, stopping on EOS, a stop string, the token limit or `should_stop`."""

    def __init__(
        self, loaded: LoadedModel, draft_model: LoadedModel | None = None, early_exit_layers: int = 8,
        static_cache: bool = False, lean: bool = True, prefix_cache_sessions: int = 0,
    ) -> None:
        """`lean`: run the target through `loaded.lean` where it has one (it cannot fill a static cache).
        `prefix_cache_sessions`: sessions whose KV cache is kept between requests (not with a static cache)."""
        self.loaded = loaded
        self.static_cache = static_cache
        use_lean = lean and loaded.lean is not None and not static_cache
        self.forward: Callable[..., Any] = loaded.lean if use_lean else loaded.model  # type: ignore[assignment]
        self.draft_model = draft_model
        self.early_exit_layers = early_exit_layers
        self._shallow: torch.nn.Module | None = None
        self._quantized: LeanLlama | None = None
        self._memories: OrderedDict[str, SuffixDrafter] = OrderedDict()
        self.last_stats = GenerationStats()
        # Learned across requests: what a verified token costs here, how often matches hold.
        self.verify_cost = VerifyCost()
        self._match_acceptance: dict[tuple[str, int], MatchAcceptance] = {}
        self.costs = CostMeter()  # what prefills and steps take here, for the latency budget
        self.prefix_cache = PrefixCache(0 if static_cache else prefix_cache_sessions)

    @classmethod
    def from_options(cls, loaded: LoadedModel, options: LlmOptions) -> Generator:
        """The target with the configured draft model, early-exit depth, KV cache kind and prefix cache."""
        return cls(loaded, load_draft_model(options, loaded), options.early_exit_layers, options.static_cache,
                   prefix_cache_sessions=options.prefix_cache_sessions)

    @property
    def drafters(self) -> tuple[str, ...]:
        return (*MODEL_FREE_DRAFTERS, *((EARLY_EXIT,) if self.early_exit_layers else ()),
                *((QUANTIZED,) if quantized_draft_applies(self.loaded) else ()),
                *(("draft",) if self.draft_model else ()))

    def check(self, request: GenerationRequest) -> None:
        if request.drafter not in self.drafters:
            raise ValueError(f"unknown drafter {request.drafter!r}: choose one of {', '.join(self.drafters)}")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        request.sampling.validate()
        room = self.loaded.context_tokens - request.max_new_tokens
        if len(request.prompt_ids) > room:
            raise PromptTooLongError(
                f"prompt of {len(request.prompt_ids)} tokens plus {request.max_new_tokens} new tokens "
                f"exceeds the {self.loaded.context_tokens}-token context window"
            )

    def warm_up(self, new_tokens: int = 4, drafters: tuple[str, ...] = ("none",)) -> None:
        """A short generation with each drafter, so the first request does not pay for lazy
        initialisation (the `quantized` drafter builds its 4-bit copy of the target here)."""
        prompt = tuple(self.loaded.tokenizer.encode("Hello"))  # type: ignore[attr-defined]
        for drafter in drafters:
            for _ in self.steps(GenerationRequest(prompt, new_tokens, drafter)):
                pass

    @torch.inference_mode()
    def steps(
        self, request: GenerationRequest, should_stop: Callable[[], bool] = lambda: False
    ) -> Iterator[DecodeStep]:
        self.check(request)
        for step in _Run(self, request).steps(should_stop):
            if step.stats is not None:
                self.last_stats = step.stats
            yield step

    def prefill(self, decoder: RequestDecoder, cache: Any = None) -> Any:
        """A one-row cache holding the prompt but its last token: the session's cached prefix,
        where it has one, plus a prefill of the rest. `cache`: where to prefill when nothing is cached."""
        prompt = decoder.request.prompt_ids
        cached, reused = self.prefix_cache.take(decoder.request.session_key, prompt)
        cache = cached if cached is not None else cache
        rest = prompt[reused:-1]
        started = time.perf_counter()
        if rest:
            cache = self.forward(input_ids=torch.tensor([rest], device=self.loaded.device), cache=cache,
                                 use_cache=True, logits_to_keep=1).cache
            if self.loaded.device.type == "cuda":
                torch.cuda.synchronize(self.loaded.device)
        decoder.prefilled(reused, time.perf_counter() - started)
        return cache

    def remember(self, decoder: RequestDecoder, cache: Any) -> None:
        """Keep a finished request's cache (every context token but the last) for its session's next one."""
        self.prefix_cache.put(decoder.request.session_key, decoder.context[:-1], cache)

    def drafter_for(self, request: GenerationRequest, generator: torch.Generator | None) -> Drafter:
        if request.drafter == "ngram":
            return PromptLookupDrafter()
        if request.drafter == "suffix":
            return self._memory(request.session_key)
        if request.drafter == "draft" and self.draft_model:
            return ModelDrafter(self.draft_model.model, self.draft_model.device, request.sampling, generator)
        if request.drafter == EARLY_EXIT:
            if self._shallow is None:
                self._shallow = early_exit_model(self.loaded.model, self.early_exit_layers)
            return ModelDrafter(self._shallow, self.loaded.device, request.sampling, generator, name=EARLY_EXIT)
        if request.drafter == QUANTIZED:
            if self._quantized is None:
                self._quantized = quantized_self_draft(self.loaded)
            return ModelDrafter(self._quantized, self.loaded.device, request.sampling, generator, name=QUANTIZED)
        return NoDrafter()

    def controller_for(self, request: GenerationRequest, drafter: Drafter) -> DraftLengthController:
        """The request's draft-length controller, sharing what earlier requests measured.

        Seeded sampling must replay exactly, so its γ may depend neither on timing nor on
        earlier requests: it gets fixed costs and statistics of its own. (Greedy output
        does not depend on γ at all.)
        """
        if request.sampling.seed is not None and not request.sampling.greedy:
            return DraftLengthController(
                max_gamma=request.max_draft_tokens, adaptive=request.adaptive_draft,
                verify=VerifyCost(frozen=True), matches=MatchAcceptance(request.max_draft_tokens),
                draft_cost=0.0 if drafter.model_free else SEEDED_DRAFT_COST, measure_draft_cost=False)
        matches = None
        if drafter.model_free:
            key = (drafter.name, request.max_draft_tokens)
            matches = self._match_acceptance.setdefault(key, MatchAcceptance(request.max_draft_tokens))
        return DraftLengthController(max_gamma=request.max_draft_tokens, adaptive=request.adaptive_draft,
                                     verify=self.verify_cost, matches=matches)

    def _memory(self, session_key: str) -> SuffixDrafter:
        if not session_key:
            return SuffixDrafter()
        memory = self._memories.pop(session_key, None) or SuffixDrafter()
        self._memories[session_key] = memory
        while len(self._memories) > SESSIONS_REMEMBERED:
            self._memories.popitem(last=False)
        return memory


class RequestDecoder:
    """One request's decoding state, whatever drives the target: `_Run` alone, or a batch.

    A step is `propose` (the draft, its length chosen by the controller), a target pass
    over [last, x_1..x_γ] run by the caller, `verify` (accept a prefix, commit one token of
    the target's own), then `emit` (cut at EOS, a stop string or the token limit).
    """

    def __init__(self, generator: Generator, request: GenerationRequest,
                 should_stop: Callable[[], bool] = lambda: False) -> None:
        loaded = generator.loaded
        self.request, self.sampling, self.should_stop = request, request.sampling, should_stop
        seed = self.sampling.seed
        self.rng = None if seed is None else torch.Generator(device=loaded.device).manual_seed(seed)
        self.drafter: Drafter = generator.drafter_for(request, self.rng)
        self.control = generator.controller_for(request, self.drafter)
        self.costs = generator.costs
        self.context = list(request.prompt_ids)
        self.new: list[int] = []
        self.detok = IncrementalDetokenizer(loaded.tokenizer)
        self.text = ""
        self.stats = GenerationStats()
        self.seq = 0
        self.eos = loaded.eos_token_ids
        self.draft: list[int] = []
        self.draft_q: torch.Tensor | None = None
        self.draft_s = 0.0
        self.match = 0
        self.committed: list[int] = []
        self.stats.prompt_tokens = len(request.prompt_ids)

    def prefilled(self, cached_tokens: int, seconds: float) -> None:
        """The prompt is in the cache: `cached_tokens` of it were the session's, the rest took `seconds`."""
        self.stats.prefix_cached_tokens, self.stats.prefill_s = cached_tokens, seconds
        self.costs.observe_prefill(len(self.request.prompt_ids) - 1 - cached_tokens, seconds)

    def propose(self, max_gamma: int | None = None) -> None:
        """This step's draft; `max_gamma` caps it below the request's own limit (a batch's budget)."""
        limit = self.request.max_new_tokens - len(self.new) - 1  # the step commits one token of its own
        if max_gamma is not None:
            limit = min(limit, max_gamma)
        started = time.perf_counter()
        if self.drafter.name == "none" or limit < 1:
            draft = EMPTY
        elif self.drafter.model_free:  # drafting is free: propose the most, keep what pays
            draft = self.drafter.propose(self.context, min(self.control.max_gamma, limit))
            draft = dataclasses.replace(draft, tokens=draft.tokens[: self.control.gamma_for_match(
                draft.match, len(draft.tokens), limit)])
        else:
            gamma = self.control.next_gamma(limit)
            draft = self.drafter.propose(self.context, gamma) if gamma else EMPTY
        self.draft_s = time.perf_counter() - started
        self.draft, self.match = list(draft.tokens), draft.match
        self.draft_q = None if draft.q is None else draft.q[: len(self.draft)]

    def verify(self, logits: torch.Tensor, target_s: float, own_pass: bool = True) -> int:
        """Accept a prefix of the draft from the target's logits [γ+1, V]; returns how many.

        `own_pass`: the pass verified this request alone, so its time is this request's
        verify cost (a batch's pass time is not, and teaches the controller nothing).
        """
        x = self.draft
        logits = apply_repetition_penalty(logits, self.context, x, self.sampling.repetition_penalty)
        if self.sampling.greedy:
            n, next_token = greedy_verify(x, logits)
        else:
            n, next_token = speculative_verify(x, logits_to_probs(logits, self.sampling), self.draft_q, self.rng)
        self.committed = [*x[:n], next_token]
        self.context += self.committed
        self._account(len(x), n, target_s, own_pass)
        return n

    def emit(self) -> DecodeStep:
        """The step made of what `verify` committed, cut at EOS, a stop string or the token limit."""
        tokens, finish = self.committed, None
        for i, token in enumerate(tokens):
            if token in self.eos:
                tokens, finish = tokens[:i], "eos"
                break
        self.new += tokens
        self.stats.new_tokens = len(self.new)
        delta = self.detok.push(tokens)
        delta, finish = self._stop_strings(delta, finish)
        if finish is None and len(self.new) >= self.request.max_new_tokens:
            finish = "length"
        step = DecodeStep(self.seq, tuple(tokens), delta, finish, len(self.draft),
                          prefix_cached_tokens=self._first_step_cached())
        self.seq += 1
        return self.last(step) if finish else step

    def cancelled(self) -> DecodeStep:
        return self.last(DecodeStep(self.seq, (), "", "cancelled", prefix_cached_tokens=self._first_step_cached()))

    def _first_step_cached(self) -> int:
        return self.stats.prefix_cached_tokens if self.seq == 0 else 0

    def last(self, step: DecodeStep) -> DecodeStep:
        """The reply is over: let the drafter learn from it, attach the statistics."""
        self.drafter.commit(self.context)
        return dataclasses.replace(step, stats=self.stats)

    def _account(self, drafted: int, accepted: int, target_s: float, own_pass: bool) -> None:
        self.stats.predicted_speedup_sum += self.control.predicted_speedup(drafted, self.drafter.model_free)
        self.stats.record(drafted, accepted)
        self.stats.draft_s += self.draft_s
        self.stats.target_s += target_s
        if own_pass:
            self.control.verify.observe(drafted + 1, target_s)
        self.costs.observe_step(self.drafter.name, drafted, accepted + 1, target_s + self.draft_s)
        plain_step_s = target_s / (1 + self.control.verify_cost_per_token * drafted)
        cost = (self.draft_s / drafted) / plain_step_s if drafted and not self.drafter.model_free else None
        self.control.observe(drafted, accepted, cost, self.match)

    def _stop_strings(self, delta: str, finish: str | None) -> tuple[str, str | None]:
        """Cut the reply at the first stop string, even one that a draft carried in whole."""
        if not self.request.stop_strings:
            return delta, finish
        before = len(self.text)
        self.text += delta
        hits = [i for s in self.request.stop_strings if (i := self.text.find(s, max(0, before - len(s)))) >= 0]
        if not hits:
            return delta, finish
        cut = min(hits)
        return self.text[before:cut] if cut > before else "", "stop"


class _Run:
    """One request decoded alone, with a KV cache of its own."""

    def __init__(self, generator: Generator, request: GenerationRequest) -> None:
        self.generator, self.loaded, self.forward = generator, generator.loaded, generator.forward
        self.decoder = RequestDecoder(generator, request)
        room = len(request.prompt_ids) + request.max_new_tokens + request.max_draft_tokens + 1
        self.cache = new_kv_cache(self.loaded.model, room, generator.static_cache)

    def steps(self, should_stop: Callable[[], bool]) -> Iterator[DecodeStep]:
        decoder = self.decoder
        self.cache = self.generator.prefill(decoder, self.cache)
        while True:
            if should_stop():
                self.generator.remember(decoder, self.cache)
                yield decoder.cancelled()
                return
            decoder.propose()
            started = time.perf_counter()
            logits = self._forward([decoder.context[-1], *decoder.draft], keep_logits=len(decoder.draft) + 1)
            decoder.verify(logits, time.perf_counter() - started)
            rollback(self.cache, len(decoder.context) - 1)  # drop the keys and values of the rejected tail
            step = decoder.emit()
            if step.finish_reason:
                self.generator.remember(decoder, self.cache)  # before the yield: a caller may stop at the last step
                yield step
                return
            yield step

    def _forward(self, tokens: list[int], keep_logits: int) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.loaded.device)
        out = self.forward(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep_logits)
        self.cache = out.cache
        return out.logits[0]
