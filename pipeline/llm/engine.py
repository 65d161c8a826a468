"""Decoding as a sequence of verified steps: speculative decoding with any drafter.

A step drafts γ tokens, verifies them in one target forward pass over [last, x_1..x_γ],
keeps the accepted prefix plus one token of the target's own (recovered or bonus, see
pipeline/llm/sampling.py) and rolls the KV cache back over the rejected tail. With the
`none` drafter γ is 0 and a step is one plain decoding step, through the same code.
Consumers (the Redis token stream, the gRPC reply) see only steps of verified tokens.

Invariant of the loop: the target's cache holds every token of `context` but the last.
A request with a session key starts from that session's cached prefix where it has one
(pipeline/llm/prefix_cache.py) and leaves its own cache there when it ends.

A request may resume a reply that another worker left half done (`resume_tokens`, the
tokens its log holds): the context starts as prompt + those tokens, the prompt is
prefilled as a fresh request prefills it and the resumed tokens are replayed as decoding
computed them (`Generator.prefill`), so the reply goes on as if nothing had happened:
token for token for greedy decoding, and for seeded sampling, whose random numbers are
drawn per output position (sampling.PositionalRandom).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.llm.budget import CostMeter
from pipeline.llm.caption_constraint import TokenConstraint, TranscriptDrafter
from pipeline.llm.cuda_graph_step import Stopwatch
from pipeline.llm.detokenize import IncrementalDetokenizer
from pipeline.llm.draft_head import HeadDrafter, TrainedHead, find_heads
from pipeline.llm.draft_length import (
    BranchWorth,
    DraftCost,
    DraftGuard,
    DraftLengthController,
    MatchAcceptance,
    VerifyCost,
)
from pipeline.llm.drafters import (
    EMPTY,
    Drafter,
    ModelDrafter,
    NoDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
)
from pipeline.llm.kv_cache import KVCache
from pipeline.llm.lean_llama import LeanLlama
from pipeline.llm.model import (
    LoadedModel,
    early_exit_model,
    load_draft_model,
    new_kv_cache,
    quantized_draft_applies,
    quantized_self_draft,
    rollback,
)
from pipeline.llm.options import LlmOptions, SamplingOptions
from pipeline.llm.prefix_cache import PrefixCache
from pipeline.llm.prompts import PromptTooLongError
from pipeline.llm.sampling import (
    DRAFT_STREAM,
    PositionalRandom,
    apply_repetition_penalty,
    generator_at,
    greedy_tokens,
    greedy_verify,
    logits_to_probs,
    sample,
    speculative_verify,
)
from pipeline.llm.token_tree import TokenTree

MODEL_FREE_DRAFTERS = ("none", "ngram", "suffix")
TRANSCRIPT = "transcript"  # a caption's drafter: its transcript's own tokens (caption_constraint.TranscriptDrafter)
EARLY_EXIT = "early-exit"
QUANTIZED = "quantized"  # the target's own weights at 4 bits (model.quantized_self_draft)
# The suffix drafter's session memories, together, in tokens (~450 bytes each: ~30 MB); least
# recently used sessions dropped past it. A count of sessions let a stack that meets many new
# sessions grow toward 256 full memories (~0.5 GB); a dropped session drafts from its prompt again.
REMEMBERED_TOKENS = 65_536
SEEDED_DRAFT_COST = 0.25  # one draft step / one target step, assumed (not timed) for seeded sampling
TREE_MAX_NODES = 16  # a token tree's nodes at most: the verification pass's rows grow with them
KEPT_CONSTRAINTS = 8  # caption automata kept by transcript (a resumed caption, a caption asked again)
REPLAY_ROWS = 16  # tokens per catch-up pass of a transformers drafter under seeded sampling (see ModelDrafter)


@dataclass(frozen=True)
class DecodeStep:
    seq: int  # 0, 1, 2, … within the reply
    token_ids: tuple[int, ...]  # the tokens this step committed, in order
    text_delta: str
    finish_reason: str | None = None  # "eos", "length", "stop" or "cancelled" on the last step
    drafted: int = 0  # γ: tokens the drafter proposed for this step
    stats: GenerationStats | None = None  # on the last step
    prefix_cached_tokens: int = 0  # on the first step: prompt tokens whose keys and values were cached
    offset: int = 0  # index in the reply of this step's first token (resumed tokens count)

    @property
    def accepted(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class GenerationRequest:
    """One reply to decode. `resume_tokens` and `resume_seq` continue a reply from its log.

    A resumed request is the original request (same prompt, max_new_tokens, sampling options
    and seed, stop strings) plus the reply's tokens already accepted, in order, and the
    sequence number its next step takes. The engine prefills prompt + resumed tokens, emits
    only what follows them (steps numbered from `resume_seq`, their `offset`s counting the
    resumed tokens), counts them against `max_new_tokens`, cuts at EOS and stop strings as
    the uninterrupted reply would, and primes the detokenizer with them, so the text deltas
    go on exactly where the log's stopped. Greedy replies are the uninterrupted reply token
    for token with any drafter, and seeded sampled ones too (with a model drafter, with the
    same drafter); see `Generator.prefill` and docs/algorithms.md, "Resuming a reply".
    A reply its resumed tokens already end (the token limit, a stop string) ends at once
    with an empty last step.
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    drafter: str = "none"
    sampling: SamplingOptions = SamplingOptions()
    max_draft_tokens: int = 8
    adaptive_draft: bool = True
    # A model-free drafter's other continuations, verified with its draft as a token tree in one
    # pass (pipeline/llm/token_tree.py): 0, a plain draft.
    draft_branches: int = 0
    stop_strings: tuple[str, ...] = ()
    session_key: str = ""  # lets the suffix drafter remember what this session said, and the prefix cache its KV
    resume_tokens: tuple[int, ...] = ()  # the reply's tokens already accepted (the token log's, in order)
    resume_seq: int = 0  # seq of the first step this request emits: the log's last seq + 1 (0 for a new reply)
    # A caption of this transcript: every step's logits masked to the faithful captions of it
    # (pipeline/llm/caption_constraint.py), in plain decoding and in verification alike. "": no constraint.
    caption_of: str = ""

    def resumed(self, tokens: Sequence[int], next_seq: int) -> GenerationRequest:
        """This request, continued after `tokens` (every token its log accepted, in order), its
        next step numbered `next_seq` (the log's last seq + 1)."""
        return dataclasses.replace(self, resume_tokens=tuple(int(t) for t in tokens), resume_seq=next_seq)


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
    resumed_tokens: int = 0  # of the reply, from its log (not in new_tokens, which this request committed)

    def record(self, drafted: int, accepted: int, nodes: int | None = None) -> None:
        """A step that drafted `drafted` positions (a tree: its depth, `nodes` tokens) and accepted `accepted`."""
        self.steps += 1
        self.drafted_tokens += drafted if nodes is None else nodes
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
            "resumed_tokens": self.resumed_tokens,
        }


class Generator:
    """Runs a request as decode steps, stopping on EOS, a stop string, the token limit or `should_stop`."""

    def __init__(
        self, loaded: LoadedModel, draft_model: LoadedModel | None = None, early_exit_layers: int = 8,
        static_cache: bool = False, lean: bool = True, prefix_cache_sessions: int = 0, prefix_cache_mb: int = 0,
    ) -> None:
        """`lean`: run the target through `loaded.lean` where it has one (it cannot fill a static cache).
        `prefix_cache_sessions`: sessions whose KV cache is kept between requests (not with a static cache),
        holding at most `prefix_cache_mb` MiB together (0: no bound in bytes)."""
        self.loaded = loaded
        self.static_cache = static_cache
        use_lean = lean and loaded.lean is not None and not static_cache
        self.forward: Callable[..., Any] = loaded.lean if use_lean else loaded.model  # type: ignore[assignment]
        self.draft_model = draft_model
        self.early_exit_layers = early_exit_layers
        self._shallow: Any = None  # the early-exit drafter: the lean pass truncated, else transformers' model
        self._quantized: LeanLlama | None = None
        self._memories: OrderedDict[str, SuffixDrafter] = OrderedDict()
        self._constraints: OrderedDict[str, TokenConstraint] = OrderedDict()  # by transcript, the latest last
        self.last_stats = GenerationStats()
        self._forget_drafting_measurements()
        self.costs = CostMeter()  # what prefills and steps take here, for the latency budget
        self.prefix_cache = PrefixCache(0 if static_cache else prefix_cache_sessions, prefix_cache_mb << 20)
        self.draft_heads: dict[str, TrainedHead] = {}  # trained heads for this target by kind (`from_options`)

    def _forget_drafting_measurements(self) -> None:
        """What is learned across requests, from nothing: what a verified token costs here, how often
        matches hold, what a drafter costs and whether it pays, which tree branches pay."""
        self.verify_cost = VerifyCost()
        self._match_acceptance: dict[tuple[str, int], MatchAcceptance] = {}
        self._draft_costs: dict[str, DraftCost] = {}  # a model drafter's c and α, across requests
        self.guards: dict[str, DraftGuard] = {}  # per drafter: drafting on or off, from measured costs
        self._branch_worth: dict[str, BranchWorth] = {}  # per model-free drafter: which tree branches pay

    @classmethod
    def from_options(cls, loaded: LoadedModel, options: LlmOptions) -> Generator:
        """The target with the configured draft model, early-exit depth, KV cache kind and prefix cache."""
        generator = cls(loaded, load_draft_model(options, loaded), options.early_exit_layers, options.static_cache,
                        prefix_cache_sessions=options.prefix_cache_sessions, prefix_cache_mb=options.prefix_cache_mb)
        if isinstance(generator.forward, LeanLlama) and options.draft_heads != "off":  # they read its features
            generator.draft_heads = find_heads(options.model, loaded.model, options.draft_heads)
            for head in generator.draft_heads.values():
                head.run_on(generator.forward)  # through the target's kernels where it has them
        return generator

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters any request may name (a caption's `transcript` drafter besides: `check`)."""
        return (*MODEL_FREE_DRAFTERS, *((EARLY_EXIT,) if self.early_exit_layers else ()),
                *((QUANTIZED,) if quantized_draft_applies(self.loaded) else ()),
                *(("draft",) if self.draft_model else ()), *self.draft_heads)

    def check(self, request: GenerationRequest) -> None:
        if request.drafter not in self.drafters and request.drafter != TRANSCRIPT:
            raise ValueError(f"unknown drafter {request.drafter!r}: choose one of {', '.join(self.drafters)}")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.drafter == TRANSCRIPT and not request.caption_of:
            raise ValueError("the transcript drafter drafts captions: the request has no transcript (caption_of)")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        request.sampling.validate()
        self._check_resume(request)
        room = self.loaded.context_tokens - request.max_new_tokens
        if len(request.prompt_ids) > room:
            raise PromptTooLongError(
                f"prompt of {len(request.prompt_ids)} tokens plus {request.max_new_tokens} new tokens "
                f"exceeds the {self.loaded.context_tokens}-token context window"
            )

    def _check_resume(self, request: GenerationRequest) -> None:
        resume, seq = request.resume_tokens, request.resume_seq
        vocab = int(getattr(self.loaded.model.config, "vocab_size", 0) or 0)
        if vocab and any(not 0 <= t < vocab for t in resume):
            raise ValueError(f"resume_tokens hold ids outside the vocabulary of {vocab}")
        if any(t in self.loaded.eos_token_ids for t in resume):
            raise ValueError("resume_tokens hold an end-of-sequence token: a reply never emits one (that one is over)")
        # every step but a reply's last commits a token, so a log of `seq` steps holds at least `seq` tokens
        if not (seq <= len(resume) and (seq >= 1 if resume else seq == 0)):
            raise ValueError(f"resume_seq {seq} does not fit {len(resume)} resumed tokens: it is the seq of the "
                             "next step, the log's last seq + 1, between 1 and the number of tokens")

    def warm_up(self, new_tokens: int = 4, drafters: tuple[str, ...] = ("none",)) -> None:
        """A short generation with each drafter, and a short caption, so the first request does not
        pay for lazy initialisation (the `quantized` drafter builds its 4-bit copy of the target here,
        the first caption's constraint the vocabulary's byte trie: a first live caption took 1.3 s
        against 0.2 s for the next).

        Its passes are the process's first of each size, cold, so what they measured is forgotten:
        they once left a verified token's cost b at 0.38 of a step where steady passes measure
        0.08-0.11 (int4-q8, 2026-12-05), and the first requests drafted little or not at all."""
        prompt = tuple(self.loaded.tokenizer.encode("Hello"))  # type: ignore[attr-defined]
        if isinstance(self.forward, LeanLlama) and any(d != "none" for d in drafters):
            self.forward.record_graphs(GenerationRequest.max_draft_tokens + 1)  # CUDA: verification passes
        requests = [GenerationRequest(prompt, new_tokens, drafter) for drafter in drafters]
        requests.append(GenerationRequest(prompt, new_tokens, TRANSCRIPT, caption_of="Hello"))
        for request in requests:
            for _ in self.steps(request):
                pass
        self._forget_drafting_measurements()

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
        """A one-row cache holding the context but its last token: the session's cached prefix,
        where it has one, plus a prefill of the rest. `cache`: where to prefill when nothing is cached.

        The prompt's uncached part is one pass, as ever. A resumed reply's tokens (from the
        prompt's last token on: plain decoding fed that one in its first step) are replayed
        as decoding computed them (`replay`), not prefilled with the prompt: a pass of many
        tokens rounds otherwise than one-token steps do, and in bfloat16 by enough to change
        tokens (docs/algorithms.md, "Resuming a reply").
        """
        context, prompt_len = decoder.context, len(decoder.request.prompt_ids)
        cached, reused = self.prefix_cache.take(decoder.request.session_key, context)
        cache = cached if cached is not None else cache
        head = context[reused : prompt_len - 1]
        tail = context[max(reused, prompt_len - 1) : -1]
        started = Stopwatch()
        if head:
            out = self.forward(input_ids=torch.tensor([head], device=self.loaded.device), cache=cache,
                               use_cache=True, logits_to_keep=1)
            cache = out.cache
            hidden = getattr(out, "hidden", None)
            if hidden is not None and not tail:  # a head drafter starts from the prompt's last token but one
                decoder.observe_features(len(context) - 2, hidden[0, -1:])
        if tail:
            cache = self.replay(tail, cache)
        if (head or tail) and self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)
        decoder.prefilled(reused, started.seconds)
        return cache

    @property
    def exact_rows(self) -> int:
        """The most tokens one replay pass holds (`replay`): the lean pass's `exact_rows`, else 1."""
        return self.forward.exact_rows if isinstance(self.forward, LeanLlama) else 1

    def replay(self, tokens: Sequence[int], cache: Any) -> Any:
        """`cache` grown by `tokens`' keys and values, bit for bit what one-token decoding steps
        compute: passes of `exact_rows` tokens whose rows each attend alone (`rows_alone`) with
        row-invariant products, or one pass per token where the products are not row-invariant."""
        rows = self.exact_rows
        extra = {"rows_alone": True} if isinstance(self.forward, LeanLlama) else {}
        for start in range(0, len(tokens), rows):
            ids = torch.tensor([list(tokens[start : start + rows])], device=self.loaded.device)
            cache = self.forward(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **extra).cache
        return cache

    def remember(self, decoder: RequestDecoder, cache: Any) -> None:
        """Keep a finished request's cache (every context token but the last) for its session's next one."""
        self.prefix_cache.put(decoder.request.session_key, decoder.context[:-1], cache)

    def constraint_for(self, request: GenerationRequest) -> TokenConstraint | None:
        """A caption request's constraint (its automaton's masks, kept for the next request of the same
        transcript: a resumed or retried caption)."""
        if not request.caption_of:
            return None
        constraint = self._constraints.get(request.caption_of)
        if constraint is None:
            constraint = TokenConstraint(request.caption_of, self.loaded.tokenizer, self.loaded.eos_token_ids)
            self._constraints[request.caption_of] = constraint
            while len(self._constraints) > KEPT_CONSTRAINTS:
                self._constraints.popitem(last=False)
        self._constraints.move_to_end(request.caption_of)
        return constraint

    def transcript_drafter(self, request: GenerationRequest, constraint: TokenConstraint) -> Drafter:
        """A caption's drafter: its transcript's own tokens, from where `constraint`'s automaton stands."""
        return TranscriptDrafter(constraint, request.caption_of, self.loaded.tokenizer, len(request.prompt_ids))

    def drafter_for(self, request: GenerationRequest, random: PositionalRandom | None = None) -> Drafter:
        """The request's drafter. A model drafter under seeded sampling (`random`) draws the draft
        token at reply position n from position n's draft stream, and computes q alike however
        its passes fall (`ModelDrafter`'s `exact_rows`), so that a resumed reply drafts as the
        uninterrupted one did."""
        if request.drafter == "ngram":
            return PromptLookupDrafter(branches=request.draft_branches)
        if request.drafter == "suffix":
            memory = self._memory(request.session_key, len(request.prompt_ids) + request.max_new_tokens + 1)
            memory.branches = request.draft_branches
            return memory
        if request.drafter in self.draft_heads:
            start = len(request.prompt_ids)
            head = self.draft_heads[request.drafter].drafter(request.sampling, None if random is None else
                                                             lambda index: random.at(index - start, DRAFT_STREAM))
            head.branches = request.draft_branches
            return head
        model: Any
        if request.drafter == "draft" and self.draft_model:
            model, device, name = self.draft_model.lean or self.draft_model.model, self.draft_model.device, "draft"
        elif request.drafter == EARLY_EXIT:
            if self._shallow is None:
                self._shallow = (self.forward.truncated(self.early_exit_layers) if isinstance(self.forward, LeanLlama)
                                 else early_exit_model(self.loaded.model, self.early_exit_layers))
            model, device, name = self._shallow, self.loaded.device, EARLY_EXIT
        elif request.drafter == QUANTIZED:
            if self._quantized is None:
                self._quantized = quantized_self_draft(self.loaded)
            model, device, name = self._quantized, self.loaded.device, QUANTIZED
        else:
            return NoDrafter()
        prompt_len = len(request.prompt_ids)
        generator = None
        exact_rows = 0
        if random is not None:
            def generator(index: int) -> torch.Generator:  # index: in the context; n: in the reply
                return random.at(index - prompt_len, DRAFT_STREAM)
            if not request.sampling.greedy:
                exact_rows = model.exact_rows if isinstance(model, LeanLlama) else REPLAY_ROWS
        return ModelDrafter(model, device, request.sampling, generator, name=name, prompt_tokens=prompt_len,
                            exact_rows=exact_rows)

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
        matches, shared = None, None
        if drafter.model_free:
            key = (_measured_as(request, drafter), request.max_draft_tokens)
            matches = self._match_acceptance.setdefault(key, MatchAcceptance(request.max_draft_tokens))
        else:
            shared = self._draft_costs.setdefault(drafter.name, DraftCost())
        return DraftLengthController(max_gamma=request.max_draft_tokens, adaptive=request.adaptive_draft,
                                     verify=self.verify_cost, matches=matches, shared=shared)

    def guard_for(self, request: GenerationRequest, drafter: Drafter) -> DraftGuard | None:
        """The guard of the request's drafter, shared by its requests on the single path; None where
        γ is not the engine's to choose (a fixed draft length, seeded sampling) or nothing drafts."""
        if drafter.name in ("none", TRANSCRIPT) or not request.adaptive_draft or (
                request.sampling.seed is not None and not request.sampling.greedy):
            return None  # (a transcript's draft is what a caption mostly is: its γ follows the streak alone)
        return self.guards.setdefault(_measured_as(request, drafter), DraftGuard(judges_rate=not drafter.model_free))

    def branch_worth_for(self, request: GenerationRequest, drafter: Drafter) -> BranchWorth | None:
        """What a model-free drafter's tree branches won, shared by its requests; None where the tree's
        shape is not the engine's to choose (no branches, a fixed draft length, seeded sampling, whose
        steps must not depend on earlier requests)."""
        if not (drafter.model_free and request.draft_branches and request.adaptive_draft) or (
                request.sampling.seed is not None and not request.sampling.greedy):
            return None
        return self._branch_worth.setdefault(_measured_as(request, drafter), BranchWorth())

    def _memory(self, session_key: str, incoming: int) -> SuffixDrafter:
        """`session_key`'s suffix memory, the least recently used others dropped to leave room
        for the `incoming` tokens this request will commit to it."""
        if not session_key:
            return SuffixDrafter()
        memory = self._memories.pop(session_key, None) or SuffixDrafter()
        held = sum(len(m.memory.text) for m in self._memories.values())
        while self._memories and held + len(memory.memory.text) + incoming > REMEMBERED_TOKENS:
            held -= len(self._memories.popitem(last=False)[1].memory.text)
        self._memories[session_key] = memory
        return memory


class RequestDecoder:
    """One request's decoding state, whatever drives the target: `_Run` alone, or a batch.

    A step is `propose` (the draft, its length chosen by the controller), a target pass
    over [last, x_1..x_γ] run by the caller, `verify` (accept a prefix, commit one token of
    the target's own), then `emit` (cut at EOS, a stop string or the token limit).

    Seeded sampling draws token n of the reply from position n's generator
    (`PositionalRandom`), and with a model drafter every position is drafted: besides the
    γ verified drafts the drafter proposes one for the position past them (`phantom`),
    which the rule tests against p there instead of a plain draw from p. So whether a
    position fell inside a draft or at its end, its token is decided alike, and a seeded
    reply does not depend on γ, on how steps fell, or on a resume.
    """

    def __init__(self, generator: Generator, request: GenerationRequest,
                 should_stop: Callable[[], bool] = lambda: False) -> None:
        loaded = generator.loaded
        self.request, self.sampling, self.should_stop = request, request.sampling, should_stop
        seed = self.sampling.seed
        self.random = None if seed is None else PositionalRandom(seed, loaded.device)
        # a caption: its automaton, and where it stands after the reply so far
        self.constraint = generator.constraint_for(request)
        self.caption_states = (self.constraint.advance(self.constraint.start(), request.resume_tokens)
                               if self.constraint is not None else frozenset())
        self.drafter: Drafter = (generator.transcript_drafter(request, self.constraint)
                                 if request.drafter == TRANSCRIPT and self.constraint is not None
                                 else generator.drafter_for(request, self.random))
        self.control = generator.controller_for(request, self.drafter)
        # drafting on or off from measured costs; in a batch, the batch's guard decides (BatchedDecoder)
        self.guard = generator.guard_for(request, self.drafter)
        self.guard_drafts = False  # this step ran with the guard's drafting on
        self.branch_worth = generator.branch_worth_for(request, self.drafter)  # a model-free tree's shape
        self.offered: tuple[tuple[int, ...], tuple[tuple[int, ...], ...]] = ((), ())  # the tree's chain, branches
        self.device = loaded.device
        self.costs = generator.costs
        self.prompt_len = len(request.prompt_ids)
        resumed = list(request.resume_tokens)
        self.context = [*request.prompt_ids, *resumed]
        self.new: list[int] = resumed
        self.detok = IncrementalDetokenizer(loaded.tokenizer, primed=resumed)
        self.text = self.detok.text
        self.stats = GenerationStats()
        self.first_seq = self.seq = request.resume_seq
        self.eos = loaded.eos_token_ids
        # every position drafted (see the class's docstring): seeded sampling with a model drafter
        self.draft_every_position = self.random is not None and not self.sampling.greedy and not self.drafter.model_free
        self.draft: list[int] = []
        self.tree: TokenTree | None = None  # the draft as a token tree (its nodes' tokens are `draft`)
        self.kept: list[int] = []  # the tree's nodes the last verify accepted, root to leaf
        self.phantom: int | None = None  # the draft for the position past the verified ones
        self.draft_q: torch.Tensor | None = None
        self.draft_s = 0.0
        self.match = 0
        self.committed: list[int] = []
        self.stats.prompt_tokens = len(request.prompt_ids)
        self.stats.resumed_tokens = len(resumed)

    def over_at_start(self) -> DecodeStep | None:
        """The last step, at once, of a resumed reply whose tokens already end it (its token limit,
        a stop string: the worker before died between its last step and the end of the log)."""
        if not self.new:
            return None
        if len(self.new) >= self.request.max_new_tokens:
            finish = "length"
        elif any(s in self.text for s in self.request.stop_strings):
            finish = "stop"
        else:
            return None
        step = DecodeStep(self.seq, (), "", finish, offset=len(self.new))
        self.seq += 1
        return self.last(step)

    def prefilled(self, cached_tokens: int, seconds: float) -> None:
        """The context is in the cache: `cached_tokens` of it were the session's, the rest took `seconds`."""
        self.stats.prefix_cached_tokens, self.stats.prefill_s = cached_tokens, seconds
        self.costs.observe_prefill(len(self.context) - 1 - cached_tokens, seconds)

    def propose(self, max_gamma: int | None = None, drafting: bool | None = None, tree: bool = False) -> None:
        """This step's draft; `max_gamma` caps it below the request's own limit (a batch's budget).
        `drafting`: a batch's guard's decision, in place of the request's own guard's (None: its own).
        `tree`: the caller can verify a token tree (`self.tree`), where the drafter found branches;
        `max_gamma` caps its nodes too."""
        limit = self.request.max_new_tokens - len(self.new) - 1  # the step commits one token of its own
        if max_gamma is not None:
            limit = min(limit, max_gamma)
        if self.guard is not None:
            self.guard_drafts = self.guard.drafting() if drafting is None else drafting
            limit = limit if self.guard_drafts else 0
        started = Stopwatch()
        gamma = 0
        if self.drafter.name == "none" or (limit < 1 and not self.draft_every_position):
            draft = EMPTY
        elif self.drafter.model_free:  # drafting is free: propose the most, keep what pays
            draft = self.drafter.propose(self.context, min(self.control.max_gamma, limit))
            if self.constraint is not None:  # a token the caption may not hold would be rejected: draft to it
                draft = dataclasses.replace(draft, tokens=draft.tokens[: self._caption_prefix(draft.tokens)])
            draft = dataclasses.replace(draft, tokens=draft.tokens[: self.control.gamma_for_match(
                draft.match, len(draft.tokens), limit)])
            gamma = len(draft.tokens)
        else:
            gamma = self.control.next_gamma(limit) if limit >= 1 else 0
            drafted = gamma + self.draft_every_position
            if isinstance(self.drafter, HeadDrafter):  # a tree node must pay its row (HeadDrafter, EAGLE-2)
                self.drafter.min_value = self.control.verify_cost_per_token
            draft = self.drafter.propose(self.context, drafted) if drafted else EMPTY
            gamma = min(gamma, len(draft.tokens))
        synchronize(self.device)
        self.draft_s = started.seconds
        self.draft, self.match = list(draft.tokens[:gamma]), draft.match
        self.tree = None
        if tree and gamma and draft.branches and self.constraint is None:
            chain, branches = draft.tokens[:gamma], tuple(b[:gamma] for b in draft.branches)
            if self.branch_worth is not None:  # only the branches whose gain pays their rows
                branches = self.branch_worth.keep(chain, branches, self.control.verify_cost_per_token)
            self.offered = (chain, branches)
            if branches:
                self.tree = TokenTree.from_paths([chain, *branches],
                                                 max_nodes=min(TREE_MAX_NODES, max_gamma or TREE_MAX_NODES))
                self.draft = list(self.tree.tokens)
        self.phantom = draft.tokens[gamma] if self.draft_every_position and len(draft.tokens) > gamma else None
        rows = len(self.draft) + (self.phantom is not None)
        self.draft_q = None if draft.q is None else draft.q[:rows]

    def verify(self, logits: torch.Tensor, target_s: float, own_pass: bool = True,
               features: torch.Tensor | None = None) -> int:
        """Accept a prefix of the draft from the target's logits [γ+1, V]; returns how many.

        `own_pass`: the pass verified this request alone, so its time is this request's
        verify cost (a batch's pass time is not, and teaches the controller nothing).
        `features`: the pass's last-layer outputs [γ+1, D] (`LeanOutput.hidden`), for a head drafter.
        """
        x = self.draft
        if self.tree is not None:
            return self._verify_tree(self.tree, logits, target_s, own_pass, features)
        logits = apply_repetition_penalty(logits, self.context, x, self.sampling.repetition_penalty)
        if self.constraint is not None:
            logits = self.constraint.mask(logits, self._caption_rows(x, logits.shape[0]))
        if self.sampling.greedy:
            n, next_token = greedy_verify(x, logits)
        else:
            drafts = x if self.phantom is None else [*x, self.phantom]
            n, next_token = speculative_verify(drafts, logits_to_probs(logits, self.sampling), self.draft_q,
                                               self._random_at(len(self.context) - self.prompt_len))
        self.committed = [*x[:n], next_token]
        if self.constraint is not None:
            self.caption_states = self.constraint.advance(self.caption_states, self.committed)
        if features is not None:  # the verified positions' features: the last context token's, the accepted ones'
            self.observe_features(len(self.context) - 1, features[: n + 1])
        self.context += self.committed
        self._account(len(x), n, target_s, own_pass)
        return n

    def _verify_tree(self, tree: TokenTree, logits: torch.Tensor, target_s: float, own_pass: bool,
                     features: torch.Tensor | None = None) -> int:
        """Walk the tree [1 + nodes, V] by the target's own token after each accepted node: the
        argmax, or the draw of that reply position (token_tree.py: the output is the target's).
        `features` [1 + nodes, D]: a head drafter gets the root's and the accepted path's."""
        at = self._random_at(len(self.context) - self.prompt_len)

        penalty = self.sampling.repetition_penalty

        def target_token(row: int, path: list[int]) -> int:
            row_logits = logits[row : row + 1]
            if penalty != 1.0:  # the row also penalises the path to it
                row_logits = apply_repetition_penalty(row_logits, [*self.context, *(tree.tokens[n] for n in path)],
                                                      (), penalty)
            if self.sampling.greedy:
                return int(greedy_tokens(row_logits[0]))
            return sample(logits_to_probs(row_logits, self.sampling)[0], generator_at(at, len(path)))

        self.kept, next_token = tree.walk(target_token)
        self.committed = [*(tree.tokens[n] for n in self.kept), next_token]
        if features is not None:
            self.observe_features(len(self.context) - 1, features[[0, *(1 + n for n in self.kept)]])
        if self.branch_worth is not None:
            self.branch_worth.observe(*self.offered, self.committed[:-1])
        self.context += self.committed
        self._account(max(tree.depths()), len(self.kept), target_s, own_pass, nodes=len(tree))
        return len(self.kept)

    def _caption_rows(self, draft: Sequence[int], rows: int) -> list[frozenset]:
        """The automaton's states at each row of a verification pass: after the reply, then after each draft
        token (no states past a token the caption may not hold: the pass stops there)."""
        assert self.constraint is not None
        states = [self.caption_states]
        for token in draft[: rows - 1]:
            states.append(self.constraint.advance(states[-1], (token,)))
        return states

    def _caption_prefix(self, tokens: Sequence[int]) -> int:
        """How many of a draft's first tokens the caption may hold."""
        assert self.constraint is not None
        states = self.caption_states
        for n, token in enumerate(tokens):
            allowed = self.constraint.allowed(states) if states else {}
            if token not in allowed:
                return n
            states = allowed[token]
        return len(tokens)

    def observe_features(self, first: int, features: torch.Tensor) -> None:
        """A head drafter's input: the target's last-layer outputs [m, D] of context positions first..."""
        if isinstance(self.drafter, HeadDrafter):
            self.drafter.observe(first, features)

    def _random_at(self, start: int) -> Callable[[int], torch.Generator] | None:
        """Draft index i's generator: reply position start + i's (None: torch's global one)."""
        random = self.random
        if random is None:
            return None
        return lambda i: random.at(start + i)

    def emit(self) -> DecodeStep:
        """The step made of what `verify` committed, cut at EOS, a stop string or the token limit."""
        tokens, finish = self.committed, None
        for i, token in enumerate(tokens):
            if token in self.eos:
                tokens, finish = tokens[:i], "eos"
                break
        offset = len(self.new)
        self.new += tokens
        self.stats.new_tokens = len(self.new) - self.stats.resumed_tokens
        delta = self.detok.push(tokens)
        delta, finish = self._stop_strings(delta, finish)
        if finish is None and len(self.new) >= self.request.max_new_tokens:
            finish = "length"
        step = DecodeStep(self.seq, tuple(tokens), delta, finish, len(self.draft),
                          prefix_cached_tokens=self._first_step_cached(), offset=offset)
        self.seq += 1
        return self.last(step) if finish else step

    def cancelled(self) -> DecodeStep:
        return self.last(DecodeStep(self.seq, (), "", "cancelled", prefix_cached_tokens=self._first_step_cached(),
                                    offset=len(self.new)))

    def _first_step_cached(self) -> int:
        return self.stats.prefix_cached_tokens if self.seq == self.first_seq else 0

    def last(self, step: DecodeStep) -> DecodeStep:
        """The reply is over: let the drafter learn from it, attach the statistics."""
        self.drafter.commit(self.context)
        return dataclasses.replace(step, stats=self.stats)

    def _account(self, drafted: int, accepted: int, target_s: float, own_pass: bool, nodes: int | None = None) -> None:
        """`drafted`: the draft's length, or a tree's depth; `nodes`: a tree's tokens (the pass's rows but one)."""
        nodes = drafted if nodes is None else nodes
        self.stats.predicted_speedup_sum += self.control.predicted_speedup(drafted, self.drafter.model_free)
        self.stats.record(drafted, accepted, nodes)
        self.stats.draft_s += self.draft_s
        self.stats.target_s += target_s
        if own_pass:
            self.control.verify.observe(nodes + 1, target_s)
            if self.guard_drafts and self.guard is not None:
                self.guard.observe(target_s + self.draft_s, accepted + 1, self.control.verify.seconds(1))
        self.costs.observe_step(self.drafter.name, nodes, accepted + 1, target_s + self.draft_s)
        plain_step_s = target_s / (1 + self.control.verify_cost_per_token * nodes)
        # c from the drafter's steady passes only: a catch-up over many tokens is not a draft token's price
        steady_s = getattr(self.drafter, "steady_pass_s", None) if drafted else None
        cost = steady_s / plain_step_s if steady_s is not None and not self.drafter.model_free else None
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


def _measured_as(request: GenerationRequest, drafter: Drafter) -> str:
    """The name a drafter's measurements go under: its trees cost and win otherwise than its chains."""
    trees = request.draft_branches and (drafter.model_free or isinstance(drafter, HeadDrafter))
    return f"{drafter.name}-tree" if trees else drafter.name


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer around it measures the work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads at `count` inside (0: as they are).

    A decoding step of a coded target runs its passes in the kernels, on `llm.kernel_threads` threads
    of their own; torch's operations around them (the logits' argmax, a draft's softmax, a head's
    norms) are small, but some open OpenMP regions, whose threads then spin, with the default
    `OMP_WAIT_POLICY`, on the cores the kernels' next pass needs. Measured 2026-12-05 (int4-q8, 2
    cores): a 4-token verification pass took 7.3 ms in the engine against 6.0 ms alone, and a
    one-token step after a draft 6.1 ms against 4.1; on one torch thread, or with passive waiting,
    the engine's passes cost what they cost alone. `specvox up` makes the waiting passive for its
    services; this keeps the one-process commands (generate, the benchmarks) from paying it."""
    before = torch.get_num_threads()
    if not count or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Run:
    """One request decoded alone, with a KV cache of its own."""

    def __init__(self, generator: Generator, request: GenerationRequest) -> None:
        self.generator, self.loaded, self.forward = generator, generator.loaded, generator.forward
        self.decoder = RequestDecoder(generator, request)
        room = len(request.prompt_ids) + request.max_new_tokens + request.max_draft_tokens + 1
        self.cache = new_kv_cache(self.loaded.model, room, generator.static_cache)
        self.features: torch.Tensor | None = None  # the last pass's features (`LeanOutput.hidden`)
        # token trees need the lean pass's tree mask and a cache whose slots move
        self.trees = request.draft_branches > 0 and isinstance(self.forward, LeanLlama)
        # a step's passes run in the coded kernels (their own threads): torch's operations stay on one
        self.kernels_step = isinstance(self.forward, LeanLlama) and self.forward.step is not None

    def steps(self, should_stop: Callable[[], bool]) -> Iterator[DecodeStep]:
        decoder = self.decoder
        over = decoder.over_at_start()
        if over is not None:
            yield over
            return
        self.cache = self.generator.prefill(decoder, self.cache)
        while True:
            if should_stop():
                self.generator.remember(decoder, self.cache)
                yield decoder.cancelled()
                return
            with torch_threads(1 if self.kernels_step else 0):
                decoder.propose(tree=self.trees and isinstance(self.cache, KVCache))
                past = len(decoder.context) - 1
                started = Stopwatch()  # a graph recorded in the pass is not its price
                logits = self._forward([decoder.context[-1], *decoder.draft], keep_logits=len(decoder.draft) + 1,
                                       tree=decoder.tree)
                synchronize(self.loaded.device)  # time the pass, not its launch: the cost model learns from it
                decoder.verify(logits, started.seconds, features=self.features)
                if decoder.tree is not None:  # the accepted path's keys and values, moved after the root's
                    assert isinstance(self.cache, KVCache)
                    self.cache.keep_slots(past + 1, [past + 1 + node for node in decoder.kept])
                rollback(self.cache, len(decoder.context) - 1)  # drop the keys and values of the rejected tail
                step = decoder.emit()
            if step.finish_reason:
                self.generator.remember(decoder, self.cache)  # before the yield: a caller may stop at the last step
                yield step
                return
            yield step

    def _forward(self, tokens: list[int], keep_logits: int, tree: TokenTree | None = None) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.loaded.device)
        extra = {}
        if tree is not None:
            assert isinstance(self.cache, KVCache)
            past = self.cache.get_seq_length()
            extra = {"position_ids": torch.tensor([tree.positions(past)], device=self.loaded.device),
                     "visible": tree.visible(past, self.loaded.device)[None]}
        out = self.forward(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep_logits, **extra)
        self.cache = out.cache
        hidden = getattr(out, "hidden", None)  # the lean pass's features, which a head drafter reads
        self.features = None if hidden is None else hidden[0]
        return out.logits[0]
