"""The llm's part of a turn's latency budget: what to give up, in a fixed order, when a turn runs late.

A turn's first audio is due by a deadline (the gateway's `TurnBudget`: end of the user's
speech + budget_ms). Before it prefills, the llm estimates what the first phrase still needs:

    estimate = prefill(uncached prompt tokens) + first_phrase_tokens · (ms per committed token) + synthesis_ms

and compares it with the time left. A late turn climbs this ladder (the tts stage owns the
rung before it, "first_phrase_shortened"), re-estimating after each rung:

1. late at all: the draft. "drafting_off" where the drafter's measured cost per committed
   token is above a plain step's (drafting loses on this machine now), else
   "draft_shortened" (a shorter max draft: each verification pass, and each model-drafted
   step, is shorter, so the first verified tokens come sooner);
2. still late by more than `cut_when_late_by` of the time left: "reply_capped",
   max_new_tokens down to `degraded_max_new_tokens`. It does not bring the first phrase
   nearer; a shorter reply frees the batch's passes and the tts sooner, and it costs less
   than losing context, so it comes before the last rung;
3. then, if still late: "history_dropped", older exchanges left out of the prompt (the newest
   one kept if that fits, else none), only where it shortens the prefill: with the
   session's prefix cached, a long history may cost nothing to keep.

A turn that cannot be met at all (the deadline passed) gets every rung that can act and
still completes. Nothing here touches the decoding: a degraded turn is another request
(drafter, caps, prompt), decoded as losslessly as any other.

Costs come from what the generator measured (`CostMeter`), or conservative constants before
anything was measured. Pure Python: no torch, no gRPC, no Redis.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The degradations' names, as StageTimes.degradations lists them; "first_phrase_shortened" is the tts stage's.
DRAFTING_OFF = "drafting_off"
DRAFT_SHORTENED = "draft_shortened"
REPLY_CAPPED = "reply_capped"
HISTORY_DROPPED = "history_dropped"

# Before anything is measured: pessimistic figures for the bundled target on a busy 2-core CPU
# (a quiet one decodes a token in ~40 ms and prefills ~2 ms a token).
PRIOR_STEP_MS = 80.0
PRIOR_PREFILL_MS_PER_TOKEN = 4.0
LONG_PREFILL_TOKENS = 64  # shorter prefills run the decoding path, whose time is not per token
SMOOTHING = 0.2  # weight of the newest measurement in the moving averages


@dataclass(frozen=True)
class BudgetOptions:
    first_phrase_tokens: int = 8  # tokens decoded before the first phrase can be spoken
    synthesis_ms: float = 100.0  # the tts stage's time for the first phrase
    degraded_max_new_tokens: int = 40  # reply_capped
    degraded_max_draft_tokens: int = 3  # draft_shortened
    cut_when_late_by: float = 0.25  # share of the time left a turn must still be over by before its reply is cut


@dataclass(frozen=True)
class TurnBudget:
    """The proto's TurnBudget: the first reply audio is due by `deadline_unix_ms` (0: no budget)."""

    budget_ms: int = 0
    speech_end_unix_ms: int = 0
    deadline_unix_ms: int = 0


@dataclass(frozen=True)
class Costs:
    """What a turn's parts cost here, in ms: a snapshot of `CostMeter`."""

    step_ms: float = PRIOR_STEP_MS  # one plain decoding step (one committed token)
    prefill_ms_per_token: float = PRIOR_PREFILL_MS_PER_TOKEN
    token_ms: Mapping[str, float] = field(default_factory=dict)  # per drafter: ms per committed token

    def prefill_ms(self, tokens: int) -> float:
        """A prefill costs at least one step (a short one runs the decoding path) and its tokens' share."""
        return 0.0 if tokens <= 0 else max(self.step_ms, tokens * self.prefill_ms_per_token)

    def decode_ms_per_token(self, drafter: str) -> float:
        """Measured for the drafter; a plain step where it was not (neither gain nor loss assumed)."""
        return self.step_ms if drafter == "none" else self.token_ms.get(drafter, self.step_ms)

    def drafting_loses(self, drafter: str) -> bool:
        return drafter != "none" and self.token_ms.get(drafter, 0.0) > self.step_ms


@dataclass
class CostMeter:
    """Moving averages of what the generator timed: prefills, plain steps, steps per drafter."""

    smoothing: float = SMOOTHING
    step_ms: float | None = None
    prefill_ms_per_token: float | None = None
    token_ms: dict[str, float] = field(default_factory=dict)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= LONG_PREFILL_TOKENS:
            self.prefill_ms_per_token = self._average(self.prefill_ms_per_token, 1000.0 * seconds / tokens)

    def observe_step(self, drafter: str, drafted: int, committed: int, seconds: float) -> None:
        """A step of `drafter` that drafted `drafted` tokens and committed `committed` in `seconds` (draft + verify)."""
        if committed < 1:
            return
        ms = 1000.0 * seconds
        if drafted == 0:
            self.step_ms = self._average(self.step_ms, ms)
        self.token_ms[drafter] = self._average(self.token_ms.get(drafter), ms / committed)

    def costs(self) -> Costs:
        return Costs(step_ms=self.step_ms or PRIOR_STEP_MS,
                     prefill_ms_per_token=self.prefill_ms_per_token or PRIOR_PREFILL_MS_PER_TOKEN,
                     token_ms=dict(self.token_ms))

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)


@dataclass(frozen=True)
class PromptChoice:
    """A prompt the turn may run: `exchanges` of history kept, `uncached_tokens` to prefill."""

    exchanges: int
    uncached_tokens: int


@dataclass(frozen=True)
class Plan:
    """What the llm runs for the turn, and what it gave up for the budget."""

    drafter: str
    max_new_tokens: int
    max_draft_tokens: int
    prompt: int = 0  # index into the turn's prompt choices
    degradations: tuple[str, ...] = ()
    estimate_ms: float = 0.0  # of the first phrase, for this plan
    time_left_ms: float | None = None  # None: no budget


class BudgetPolicy:
    """Plans a turn against its deadline; `clock` gives Unix ms (a fake one in tests)."""

    def __init__(self, options: BudgetOptions = BudgetOptions(),
                 clock: Callable[[], float] = lambda: time.time() * 1000.0) -> None:
        self.options, self.clock = options, clock

    def plan(self, budget: TurnBudget, requested: Plan, prompts: tuple[PromptChoice, ...], costs: Costs) -> Plan:
        """`requested`: the turn as asked (prompt 0 = `prompts[0]`, the fullest); `prompts`: fullest first."""
        plan = dataclasses.replace(requested, estimate_ms=self.estimate(requested, prompts, costs))
        if not budget.deadline_unix_ms:
            return plan
        left = budget.deadline_unix_ms - self.clock()
        plan = dataclasses.replace(plan, time_left_ms=left)
        far = left * (1.0 + self.options.cut_when_late_by) if left > 0 else left
        for rung, over in ((self._draft, left), (self._reply, far), (self._history, far)):
            if plan.estimate_ms <= over:
                break
            plan = rung(plan, prompts, costs, left)
            plan = dataclasses.replace(plan, estimate_ms=self.estimate(plan, prompts, costs))
        return plan

    def estimate(self, plan: Plan, prompts: tuple[PromptChoice, ...], costs: Costs) -> float:
        """ms until the first phrase is spoken, from now, if the turn runs `plan`."""
        decode = self.options.first_phrase_tokens * costs.decode_ms_per_token(plan.drafter)
        return costs.prefill_ms(prompts[plan.prompt].uncached_tokens) + decode + self.options.synthesis_ms

    def _draft(self, plan: Plan, prompts: tuple[PromptChoice, ...], costs: Costs, left: float) -> Plan:
        if plan.drafter == "none":
            return plan
        if costs.drafting_loses(plan.drafter):
            return _degrade(plan, DRAFTING_OFF, drafter="none")
        shorter = self.options.degraded_max_draft_tokens
        return _degrade(plan, DRAFT_SHORTENED, max_draft_tokens=shorter) if plan.max_draft_tokens > shorter else plan

    def _reply(self, plan: Plan, prompts: tuple[PromptChoice, ...], costs: Costs, left: float) -> Plan:
        cap = self.options.degraded_max_new_tokens
        return _degrade(plan, REPLY_CAPPED, max_new_tokens=cap) if plan.max_new_tokens > cap else plan

    def _history(self, plan: Plan, prompts: tuple[PromptChoice, ...], costs: Costs, left: float) -> Plan:
        """The most history that fits; where none fits, the shortest prefill; never a longer one."""
        now = prompts[plan.prompt]
        shorter = [i for i, p in enumerate(prompts)
                   if p.exchanges < now.exchanges and p.uncached_tokens < now.uncached_tokens]
        if not shorter:
            return plan
        tried = [dataclasses.replace(plan, prompt=i) for i in shorter]
        fits = [p for p in tried if self.estimate(p, prompts, costs) <= left]
        best = fits[0] if fits else min(tried, key=lambda p: self.estimate(p, prompts, costs))
        return _degrade(best, HISTORY_DROPPED)


def _degrade(plan: Plan, name: str, **changes: Any) -> Plan:
    return dataclasses.replace(plan, degradations=(*plan.degradations, name), **changes)
