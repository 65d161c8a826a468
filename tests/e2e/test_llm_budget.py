"""The llm's latency budget: which degradations a late turn gets, in order, from what was measured.

The policy is plain Python on a fake clock: a turn with time to spare keeps what it asked
for; one a little late loses its long draft (or drafting, where drafting was measured to
lose); one later by more than a quarter of its time left also has its reply capped and,
if still late, its older history dropped, but only where that shortens the prefill. A
budget that cannot be met gets every rung that can act. Through the servicer, a turn with a
1 ms budget still completes, lists what it gave up, and decodes the degraded request exactly
as the target decodes that request.
"""

from __future__ import annotations

import pytest

from pipeline.llm.budget import (
    DRAFT_SHORTENED,
    DRAFTING_OFF,
    HISTORY_DROPPED,
    PRIOR_PREFILL_MS_PER_TOKEN,
    PRIOR_STEP_MS,
    REPLY_CAPPED,
    BudgetOptions,
    BudgetPolicy,
    CostMeter,
    Costs,
    Plan,
    PromptChoice,
    TurnBudget,
)
from tests.conftest import llm_on_loopback

NOW_MS = 1_700_000_000_000
# 40 ms a plain step, 2 ms a prefilled token; the suffix drafter commits a token for 25 ms.
COSTS = Costs(step_ms=40.0, prefill_ms_per_token=2.0, token_ms={"suffix": 25.0, "early-exit": 55.0})
ASKED = Plan(drafter="suffix", max_new_tokens=96, max_draft_tokens=8)
# Three exchanges of history, nothing cached: 400 tokens to prefill, 150 with the newest exchange, 60 with none.
UNCACHED = (PromptChoice(3, 400), PromptChoice(1, 150), PromptChoice(0, 60))


class FakeClock:
    def __init__(self, now_ms: float = NOW_MS) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms


def plan(left_ms: float, asked: Plan = ASKED, prompts: tuple[PromptChoice, ...] = UNCACHED,
         costs: Costs = COSTS) -> Plan:
    """The plan for a turn whose deadline is `left_ms` from the fake clock's now."""
    policy = BudgetPolicy(BudgetOptions(), clock=FakeClock())
    return policy.plan(TurnBudget(800, NOW_MS - 800 + int(left_ms), NOW_MS + int(left_ms)), asked, prompts, costs)


def test_the_estimate_is_prefill_plus_eight_tokens_plus_synthesis():
    assert plan(10_000).estimate_ms == 400 * 2.0 + 8 * 25.0 + 100.0
    none = Plan("none", 96, 8)
    assert plan(10_000, asked=none).estimate_ms == 400 * 2.0 + 8 * 40.0 + 100.0
    assert COSTS.prefill_ms(0) == 0 and COSTS.prefill_ms(5) == 40.0  # a short prefill costs a step


def test_without_a_budget_or_with_time_to_spare_nothing_is_given_up():
    no_budget = BudgetPolicy(clock=FakeClock()).plan(TurnBudget(), ASKED, UNCACHED, COSTS)
    assert no_budget.degradations == () and no_budget.time_left_ms is None
    spare = plan(1_200)
    assert spare.degradations == () and spare.time_left_ms == 1_200
    assert (spare.drafter, spare.max_new_tokens, spare.max_draft_tokens, spare.prompt) == ("suffix", 96, 8, 0)


def test_a_turn_a_little_late_shortens_its_draft_first():
    late = plan(1_050)  # needs 1,100 ms
    assert late.degradations == (DRAFT_SHORTENED,)
    assert (late.drafter, late.max_draft_tokens, late.max_new_tokens, late.prompt) == ("suffix", 3, 96, 0)


def test_a_drafter_measured_to_lose_is_switched_off():
    late = plan(1_050, asked=Plan("early-exit", 96, 8))  # 55 ms a token against 40 for a plain step
    assert late.degradations == (DRAFTING_OFF,)
    assert late.drafter == "none" and late.estimate_ms == 400 * 2.0 + 8 * 40.0 + 100.0


def test_later_the_reply_is_capped_and_then_older_history_dropped():
    assert plan(900).degradations == (DRAFT_SHORTENED,)  # over by less than a quarter of the time left
    later = plan(800)  # over by more; the newest exchange alone fits (300 + 200 + 100 ms)
    assert later.degradations == (DRAFT_SHORTENED, REPLY_CAPPED, HISTORY_DROPPED)
    assert (later.max_new_tokens, later.prompt) == (40, 1) and later.estimate_ms == 600.0
    latest = plan(500)  # only the prompt without history fits (120 + 200 + 100 ms)
    assert latest.prompt == 2 and latest.estimate_ms <= 500


def test_a_budget_that_cannot_be_met_gets_every_rung_and_the_shortest_prefill():
    past = plan(-50)  # the deadline is behind us
    assert past.degradations == (DRAFT_SHORTENED, REPLY_CAPPED, HISTORY_DROPPED)
    assert past.prompt == 2 and past.max_new_tokens == 40 and past.max_draft_tokens == 3
    one_ms = plan(1, asked=Plan("early-exit", 96, 8))
    assert one_ms.degradations == (DRAFTING_OFF, REPLY_CAPPED, HISTORY_DROPPED)


def test_a_cached_history_is_kept_because_dropping_it_would_lengthen_the_prefill():
    cached = (PromptChoice(3, 20), PromptChoice(1, 150), PromptChoice(0, 60))  # the session's prefix is cached
    late = plan(1, prompts=cached)
    assert late.degradations == (DRAFT_SHORTENED, REPLY_CAPPED) and late.prompt == 0


def test_rungs_that_cannot_act_are_not_listed():
    asked = Plan("none", 30, 8)  # no drafting, a reply shorter than the cap, no history
    assert plan(1, asked=asked, prompts=(PromptChoice(0, 60),)).degradations == ()


def test_the_fake_clock_moves_the_deadline_closer():
    clock = FakeClock()
    policy = BudgetPolicy(clock=clock)
    budget = TurnBudget(800, NOW_MS - 100, NOW_MS + 1_150)
    assert policy.plan(budget, ASKED, UNCACHED, COSTS).degradations == ()
    clock.now_ms += 100  # the turn waited 100 ms (say, for room in the batch)
    assert policy.plan(budget, ASKED, UNCACHED, COSTS).degradations == (DRAFT_SHORTENED,)


def test_the_meter_starts_from_conservative_priors_and_follows_measurements():
    meter = CostMeter()
    assert meter.costs() == Costs(PRIOR_STEP_MS, PRIOR_PREFILL_MS_PER_TOKEN, {})
    meter.observe_prefill(20, 0.5)  # a short prefill runs the decoding path: not a per-token cost
    assert meter.costs().prefill_ms_per_token == PRIOR_PREFILL_MS_PER_TOKEN
    meter.observe_prefill(100, 0.2)
    meter.observe_step("suffix", drafted=0, committed=1, seconds=0.040)
    meter.observe_step("suffix", drafted=5, committed=3, seconds=0.060)
    costs = meter.costs()
    assert costs.prefill_ms_per_token == pytest.approx(2.0) and costs.step_ms == pytest.approx(40.0)
    assert costs.token_ms["suffix"] == pytest.approx(40.0 + 0.2 * (20.0 - 40.0))
    assert not costs.drafting_loses("suffix") and costs.decode_ms_per_token("draft") == costs.step_ms


async def test_a_one_ms_budget_through_the_service_completes_with_every_degradation(redis_url, tiny_llm_dir):
    from pipeline.llm.engine import GenerationRequest, Generator
    from pipeline.llm.options import LlmOptions
    from pipeline.llm.prompts import DEFAULT_PERSONA, Exchange, Task, fit_history
    from services.protos import load, load_common
    from services.store.client import now_ms

    llm, _ = load("llm")
    common = load_common()
    options = LlmOptions(model=str(tiny_llm_dir), dtype="float64", prefix_cache_sessions=0)
    history = (Exchange("Hello there.", "Hi! How can I help?"), Exchange("Tell me a joke.", "Why did the cat sit?"))
    async with llm_on_loopback(redis_url, options) as service:
        redis = service.redis
        session = await redis.sessions.create("")
        for exchange in history:
            await redis.sessions.append(session, exchange)
        spoke = now_ms()
        request = llm.ReplyRequest(session_id=session, turn_id=await redis.turns.create(session),
                                   user_text="Why do cats purr?", max_new_tokens=64, defer_history=True,
                                   budget=common.TurnBudget(budget_ms=1, speech_end_unix_ms=spoke,
                                                            deadline_unix_ms=spoke + 1))
        steps = [step async for step in service.stub.Reply(request)]
    settings, loaded = service.settings, service.loaded
    last = steps[-1]
    assert last.end and last.finish_reason in ("eos", "length")
    assert list(last.times.degradations) == [DRAFT_SHORTENED, REPLY_CAPPED, HISTORY_DROPPED]
    assert all(not step.times.degradations for step in steps[:-1])
    tokens = [t for s in steps for t in s.token_ids]
    assert len(tokens) <= settings.llm.degraded_max_new_tokens
    # The degraded request (no history: the tiny model's prefill costs are the priors', far over 1 ms)
    # decodes exactly as the target decodes it.
    prompt = fit_history(loaded.tokenizer, Task.DIALOGUE, "Why do cats purr?", DEFAULT_PERSONA, (), 10_000)
    reference = Generator(loaded).steps(GenerationRequest(tuple(prompt), settings.llm.degraded_max_new_tokens))
    assert tokens == [t for s in reference for t in s.token_ids]
