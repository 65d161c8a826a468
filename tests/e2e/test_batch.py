"""Batched speculative decoding is the single-request Generator, row by row.

On a true float64 target (the small random Llama of conftest.py) every row of a batch must
produce what the Generator produces for the same request alone: token for token under
greedy decoding, for every drafter, with rows joining and leaving at different steps.

Sampling: a row owns its RNG, seeded as the single-request path seeds it, and consumes it
in the same order (the drafter's draws, then the acceptance test and the recovered or bonus
draw of pipeline/llm/sampling.py) on the same target probabilities, so a seeded row must
equal the seeded single request exactly. With that equality, the distribution of batched
output is the single path's, which tests/e2e/test_speculative.py checks by chi-square against
the target. A fixed draft length (adaptive_draft=False) keeps γ, and with it the RNG
consumption and the step boundaries, independent of timing and of what the Generator has
learned from earlier requests; rows with an adaptive γ are compared token for token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable

import pytest

from pipeline.llm.batch import BatchedDecoder, BatchScheduler
from pipeline.llm.engine import DecodeStep, GenerationRequest, Generator
from pipeline.llm.options import LlmOptions, SamplingOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import DEFAULT_PERSONA, Task, chat_messages, encode_chat, fit_history
from services.protos import load
from services.server.model_worker import ModelWorker
from tests.conftest import llm_on_loopback, with_a_perturbed_draft

PROMPTS = load_prompts()
DEVICE = os.environ.get("SPECVOX_LLM__DEVICE", "cpu")  # bench/gpu_check.sh runs these on cuda
ALL_PROMPTS = [text for task in ("dialogue", "caption") for text in PROMPTS[task]]
SOME_PROMPTS = ALL_PROMPTS[::2]  # half of each set, for the slower sampling cases
DRAFTERS = ("none", "ngram", "suffix", "early-exit", "quantized", "draft")


@pytest.fixture(scope="module")
def tiny(tiny_llm_dir):
    return with_a_perturbed_draft(LlmOptions(model=str(tiny_llm_dir), dtype="float64", device=DEVICE))


def offered(generator: Generator) -> tuple[str, ...]:
    """DRAFTERS that this device has (`quantized` runs the int4 CPU kernel)."""
    return tuple(d for d in DRAFTERS if d in generator.drafters)


def encode(generator: Generator, text: str) -> tuple[int, ...]:
    return tuple(encode_chat(generator.loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))


@dataclasses.dataclass
class Scheduled:
    request: GenerationRequest
    join_at: int = 0  # batch step before which the request arrives
    should_stop: Callable[[], bool] = lambda: False


def run_batched(generator: Generator, schedule: list[Scheduled], max_batch_size: int,
                max_verify_tokens: int | None = None, **parking) -> tuple[list[list[DecodeStep]], BatchedDecoder]:
    """Steps of each scheduled request through one BatchedDecoder; arrivals wait for room.

    Without a cap on the pass, each row drafts as long as it would alone, so model-free
    rows line up with the single path step for step."""
    decoder = BatchedDecoder(generator, max_batch_size, max_verify_tokens, **parking)
    waiting = sorted(range(len(schedule)), key=lambda i: schedule[i].join_at)
    steps: list[list[DecodeStep]] = [[] for _ in schedule]
    index: dict[int, int] = {}
    tick = 0
    while waiting or decoder.active:
        while waiting and decoder.room and schedule[waiting[0]].join_at <= tick:
            i = waiting.pop(0)
            index[id(decoder.add(schedule[i].request, schedule[i].should_stop))] = i
        for row, step in decoder.step():
            steps[index[id(row)]].append(step)
        tick += 1
    return steps, decoder


def alone(generator: Generator, item: Scheduled) -> list[DecodeStep]:
    return list(generator.steps(item.request, item.should_stop))


def tokens(steps: list[DecodeStep]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


def same_steps(a: list[DecodeStep], b: list[DecodeStep]) -> bool:
    """Equal step for step: tokens, text, finish reason and draft length."""
    key = [(s.seq, s.token_ids, s.text_delta, s.finish_reason, s.drafted) for s in a]
    return key == [(s.seq, s.token_ids, s.text_delta, s.finish_reason, s.drafted) for s in b]


def stop_after(calls: int) -> Callable[[], bool]:
    """Asked once per step by both paths: True from the `calls`-th question on."""
    asked = [0]

    def should_stop() -> bool:
        asked[0] += 1
        return asked[0] >= calls

    return should_stop


def greedy_schedule(generator: Generator) -> list[Scheduled]:
    drafters = offered(generator)
    return [
        # Each drafter's first request drafts a fixed γ (no guard: it always drafts); of the rest, two in
        # three adapt, and the guard may turn their drafting off where it loses.
        Scheduled(GenerationRequest(encode(generator, text), 16 + (37 * i) % 81, drafters[i % len(drafters)],
                                    adaptive_draft=i >= len(drafters) and i % 3 != 0), join_at=(5 * i) % 23)
        for i, text in enumerate(ALL_PROMPTS)
    ]


def test_greedy_rows_equal_the_single_request_generator_for_every_drafter(tiny):
    schedule = greedy_schedule(tiny)
    batched, decoder = run_batched(tiny, schedule, max_batch_size=5)
    for item, steps in zip(schedule, batched, strict=True):
        reference = alone(tiny, item)
        assert tokens(steps) == tokens(reference), item.request.drafter
        assert steps[-1].finish_reason == reference[-1].finish_reason
        assert "".join(s.text_delta for s in steps) == "".join(s.text_delta for s in reference)
        if not item.request.adaptive_draft:  # γ fixed: the steps themselves line up one to one
            assert same_steps(steps, reference), item.request.drafter
    counters = decoder.counters
    assert max(counters.widths) == 5 and min(counters.widths) < 5  # full, and rows came and went
    assert counters.ragged_steps > 0, "no step verified drafts of different lengths"
    assert counters.compactions > 0, "the cache was never compacted"
    accepted = {d: sum(s.stats.accepted_draft_tokens for item, steps in zip(schedule, batched, strict=True)
                       for s in steps if s.stats and item.request.drafter == d and not item.request.adaptive_draft)
                for d in offered(tiny)[1:]}
    assert all(accepted.values()), f"some drafter's fixed drafts never had a token accepted: {accepted}"


def test_rows_parked_while_a_new_reply_writes_its_first_tokens_decode_as_they_would_alone(tiny):
    """First phrases first: old rows sit the steps out while a young one is urgent, and every row,
    parked or not, cancelled while parked or not, decodes what it decodes alone."""
    prompts = [encode(tiny, text) for text in ALL_PROMPTS[:6]]
    schedule = [
        Scheduled(GenerationRequest(prompts[0], 48, "ngram", adaptive_draft=False)),
        Scheduled(GenerationRequest(prompts[1], 48, "suffix")),
        Scheduled(GenerationRequest(prompts[2], 48, "none", SamplingOptions(temperature=0.8, seed=7))),
        Scheduled(GenerationRequest(prompts[3], 40, "early-exit", adaptive_draft=False), join_at=14),
        Scheduled(GenerationRequest(prompts[4], 48, "none"), join_at=15, should_stop=stop_after(18)),
        Scheduled(GenerationRequest(prompts[5], 30, "draft"), join_at=30),
    ]
    batched, decoder = run_batched(tiny, schedule, max_batch_size=6, urgent_tokens=6, park_min_tokens=12)
    for i, (item, steps) in enumerate(zip(schedule, batched, strict=True)):
        reference = alone(tiny, dataclasses.replace(item, should_stop=lambda: False))
        if i == 4:  # cancelled (a parked row is asked at each step it sits out too): a prefix of its reply
            assert steps[-1].finish_reason == "cancelled" and 0 < len(tokens(steps)) < len(tokens(reference))
            assert tokens(steps) == tokens(reference)[: len(tokens(steps))]
            continue
        assert tokens(steps) == tokens(reference), item.request.drafter
        assert steps[-1].finish_reason == reference[-1].finish_reason
        if not item.request.adaptive_draft:
            assert same_steps(steps, reference), item.request.drafter
    assert decoder.counters.parked >= 3 and not decoder.parked and not decoder.rows
    assert 1 in decoder.counters.widths  # a young row stepped alone while the others were parked
    with pytest.raises(ValueError, match="park_min_tokens"):
        BatchedDecoder(tiny, 4, urgent_tokens=8, park_min_tokens=4)


def test_greedy_rows_with_the_pass_capped_still_equal_the_single_request_generator(tiny):
    schedule = greedy_schedule(tiny)[::3]
    batched, decoder = run_batched(tiny, schedule, max_batch_size=4, max_verify_tokens=10)
    for item, steps in zip(schedule, batched, strict=True):
        assert tokens(steps) == tokens(alone(tiny, item)), item.request.drafter
    assert decoder.counters.largest_pass <= 10 and decoder.counters.ragged_steps > 0


@pytest.mark.parametrize("sampling", [
    SamplingOptions(temperature=0.7, top_k=50),
    SamplingOptions(temperature=1.0, top_p=0.9),
    SamplingOptions(temperature=1.5, repetition_penalty=1.2),
], ids=["t0.7-top-k", "t1.0-top-p", "t1.5-repetition"])
def test_seeded_sampling_rows_equal_the_single_request_generator(tiny, sampling):
    drafters = offered(tiny)
    schedule = [
        Scheduled(GenerationRequest(encode(tiny, text), 32, drafters[i % len(drafters)],
                                    dataclasses.replace(sampling, seed=1000 + i), max_draft_tokens=4,
                                    adaptive_draft=False),
                  join_at=3 * i)
        for i, text in enumerate(SOME_PROMPTS[:8])
    ]
    batched, _ = run_batched(tiny, schedule, max_batch_size=4)
    for item, steps in zip(schedule, batched, strict=True):
        assert same_steps(steps, alone(tiny, item)), item.request.drafter
    assert len({tuple(tokens(s)) for s in batched}) == len(batched)  # the seeds do differ


def test_eos_stop_string_length_and_cancellation_of_one_row_while_others_continue(tiny):
    prompts = [encode(tiny, text) for text in ALL_PROMPTS[:5]]
    plain = [tokens(alone(tiny, Scheduled(GenerationRequest(p, 64)))) for p in prompts]
    # A token the target says early in the first reply and never in the others: now an end of sequence.
    eos = next(t for t in plain[0][16:] if not any(t in other for other in plain[1:]))
    with_eos = Generator(dataclasses.replace(tiny.loaded, eos_token_ids=tiny.loaded.eos_token_ids | {eos}),
                         tiny.draft_model, early_exit_layers=2)
    text = tiny.loaded.tokenizer.decode(plain[1])
    stop = text[len(text) // 2: len(text) // 2 + 3]
    schedule = [
        Scheduled(GenerationRequest(prompts[0], 64, "ngram", adaptive_draft=False)),
        Scheduled(GenerationRequest(prompts[1], 64, "suffix", stop_strings=(stop,), adaptive_draft=False), join_at=2),
        Scheduled(GenerationRequest(prompts[2], 64, "none"), should_stop=stop_after(6)),
        Scheduled(GenerationRequest(prompts[3], 64, "ngram", adaptive_draft=False), join_at=1),
        Scheduled(GenerationRequest(prompts[4], 7, "none"), join_at=4),
    ]
    batched, _ = run_batched(with_eos, schedule, max_batch_size=8)
    references = [alone(with_eos, dataclasses.replace(item, should_stop=stop_after(6)) if i == 2 else item)
                  for i, item in enumerate(schedule)]
    for steps, reference in zip(batched, references, strict=True):
        assert same_steps(steps, reference)
    finishes = [steps[-1].finish_reason for steps in batched]
    assert finishes[0] == "eos" and tokens(batched[0]) == plain[0][: plain[0].index(eos)]
    assert finishes[1] == "stop" and stop not in "".join(s.text_delta for s in batched[1])
    assert finishes[2] == "cancelled" and batched[2][-1].token_ids == () and len(batched[2]) == 6
    assert len(tokens(batched[2])) == 5 and tokens(batched[2]) == plain[2][:5]
    assert finishes[3] in ("length", "eos") and len(batched[3]) > len(batched[2])  # went on after the cancel
    assert finishes[4] == "length" and len(tokens(batched[4])) == 7
    assert all(steps[-1].stats is not None for steps in batched)


def test_a_batch_whose_guard_holds_drafting_off_drafts_only_its_rows_of_a_fixed_draft_length(tiny):
    """The batch's guard decides for its rows whose γ is the engine's to choose (adaptive, not
    seeded); a fixed draft length is the caller's, and stays. Output is what each row decodes alone."""
    prompts = [encode(tiny, text) for text in ALL_PROMPTS[:4]]
    adaptive = zip(prompts[:3], ("draft", "early-exit", "ngram"), strict=True)
    requests = [*(GenerationRequest(p, 24, d) for p, d in adaptive),
                GenerationRequest(prompts[3], 24, "ngram", adaptive_draft=False)]
    decoder = BatchedDecoder(tiny, 4)
    decoder.guard.turn_off(wait=10**6)  # as if drafting had lost in this batch
    rows = [decoder.add(request) for request in requests]
    steps: dict[int, list[DecodeStep]] = {id(row): [] for row in rows}
    while decoder.rows:
        for row, step in decoder.step():
            steps[id(row)].append(step)
    for row, request in zip(rows, requests, strict=True):
        assert tokens(steps[id(row)]) == tokens(alone(tiny, Scheduled(request))), request.drafter
    assert all(s.drafted == 0 for row in rows[:3] for s in steps[id(row)])
    assert sum(s.drafted for s in steps[id(rows[3])]) > 0


def test_a_batchs_guard_judges_the_rate_only_while_a_model_drafter_drafts_in_it(tiny):
    """DraftGuard.judges_rate: a batch of model-free drafters is held to the loss budget alone (each
    row's γ is chosen from measured costs already); a model drafter in it brings the rate rule back."""
    prompts = [encode(tiny, text) for text in ALL_PROMPTS[:2]]
    for drafters, judged in ((("ngram", "suffix"), False), (("ngram", "early-exit"), True)):
        decoder = BatchedDecoder(tiny, 2)
        for prompt, drafter in zip(prompts, drafters, strict=True):
            decoder.add(GenerationRequest(prompt, 6, drafter))
        decoder.step()  # the first step drafts (the guard starts on) and is judged
        assert decoder.guard.judges_rate is judged, drafters


def test_a_row_cancelled_before_its_first_step_leaves_without_tokens(tiny):
    prompt = encode(tiny, ALL_PROMPTS[0])
    schedule = [Scheduled(GenerationRequest(prompt, 12)),
                Scheduled(GenerationRequest(prompt, 12), should_stop=lambda: True)]
    batched, _ = run_batched(tiny, schedule, max_batch_size=2)
    assert [s.finish_reason for s in batched[1]] == ["cancelled"] and tokens(batched[1]) == []
    assert tokens(batched[0]) == tokens(alone(tiny, schedule[0]))


def test_bad_requests_are_refused_when_they_join(tiny):
    decoder = BatchedDecoder(tiny, 1)
    with pytest.raises(ValueError, match="unknown drafter"):
        decoder.add(GenerationRequest((1, 2), 4, "telepathy"))
    with pytest.raises(ValueError, match="empty"):
        decoder.add(GenerationRequest((), 4))
    decoder.add(GenerationRequest((1, 2), 4))
    with pytest.raises(RuntimeError, match="full"):
        decoder.add(GenerationRequest((1, 2), 4))
    with pytest.raises(ValueError, match="at least 1"):
        BatchedDecoder(tiny, 0)


async def test_the_scheduler_streams_each_caller_its_own_steps_and_drops_a_caller_that_leaves(tiny):
    """Three callers at once: one leaves after two steps, one runs to the end, one is refused."""
    scheduler = BatchScheduler(BatchedDecoder(tiny, 4, max_verify_tokens=None), ModelWorker("test-llm").call)
    leaving, staying = (GenerationRequest(encode(tiny, text), n, d, adaptive_draft=False)
                        for text, n, d in ((ALL_PROMPTS[0], 64, "none"), (ALL_PROMPTS[1], 24, "ngram")))

    async def leave_after_two_steps() -> list[DecodeStep]:
        stream = scheduler.steps(leaving)
        got = [await anext(stream) for _ in range(2)]
        await stream.aclose()
        return got

    async def stay() -> list[DecodeStep]:
        return [step async for step in scheduler.steps(staying)]

    async def refused() -> BaseException | None:
        try:
            [step async for step in scheduler.steps(GenerationRequest((), 8))]
        except ValueError as e:
            return e
        return None

    left, stayed, error = await asyncio.gather(leave_after_two_steps(), stay(), refused())
    assert error is not None and "empty" in str(error)  # that caller alone hears of its bad request
    while scheduler.decoder.rows:
        await asyncio.sleep(0.01)
    assert tokens(left) == tokens(alone(tiny, Scheduled(leaving)))[: len(tokens(left))]
    assert same_steps(stayed, alone(tiny, Scheduled(staying)))
    assert scheduler.decoder.counters.steps <= 25  # the 64-token row left instead of running on


async def test_the_llm_service_answers_two_concurrent_replies_in_one_batch(redis_url, tiny_llm_dir):
    llm, _ = load("llm")
    options = LlmOptions(model=str(tiny_llm_dir), dtype="float64", max_batch_size=4, drafter="suffix")
    questions = ("Why do cats purr?", "How do bees make honey?")
    lengths = (40, 24)
    async with llm_on_loopback(redis_url, options) as service:
        sessions = [await service.redis.sessions.create("") for _ in questions]
        turns = [await service.redis.turns.create(s) for s in sessions]

        async def reply(i: int) -> list:
            request = llm.ReplyRequest(session_id=sessions[i], turn_id=turns[i], user_text=questions[i],
                                       max_new_tokens=lengths[i])
            return [step async for step in service.stub.Reply(request)]

        replies = await asyncio.gather(reply(0), reply(1))
    servicer, loaded = service.servicer, service.loaded
    assert servicer.scheduler is not None and max(servicer.scheduler.decoder.counters.widths) == 2
    for question, length, steps in zip(questions, lengths, replies, strict=True):
        prompt = fit_history(loaded.tokenizer, Task.DIALOGUE, question, DEFAULT_PERSONA, (),
                             loaded.context_tokens - length)
        reference = servicer.generator.steps(GenerationRequest(tuple(prompt), length, "suffix"))
        assert [t for s in steps for t in s.token_ids] == tokens(list(reference))
        assert steps[-1].end and steps[-1].finish_reason == "length" and steps[-1].stats_json
