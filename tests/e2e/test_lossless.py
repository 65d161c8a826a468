"""Losslessness end to end on the bundled target: sampled replies are distributed as the
target's, greedy replies are plain decoding's in a batch of any size and in every weight form.

Sampling (bench/lossless.py has the method; `specvox bench lossless` is the full-size run).
A reply's outcome is its first two tokens; the target's exact distribution of outcomes comes
from its own probabilities (no sampling), and replies sampled through the engine with every
drafter `Generator.drafters` lists, at a fixed draft length of 2, batched eight rows a pass,
and with ngram's branches verified as token trees (the benchmark: suffix's too), are counted by
outcome. Half of them are seeded. A G-test per case compares counts with
expectations. The options are temperatures 0.3, 0.7, 1.0, 1.5 and top-k and top-p: plain
sampling runs at each, every drafter at two of them in turn (`ci_grid`); the benchmark runs
every drafter at every option.

False-alarm rate: a case fails where its p-value is below ALPHA / cases (Bonferroni), so a
lossless engine fails this module's sampling test with probability at most ALPHA = 1 %
(chi-square approximation, every bin ≥ 5 expected). The replies are seeded, so a run is
reproducible: a failure repeats, it is not noise to retry.

Negative controls through the same statistic and threshold, which must be rejected: the
target sampled at 1.3× the temperature the expectation assumes, and a wrong acceptance
rule (every draft accepted, with the early-exit drafter: the reply follows q).

This is the coarse share for CI (64 replies a case: it catches a rule or a q that is wrong,
not a small bias); tests/e2e/test_speculative.py checks the rule itself at 100,000 draws on a
synthetic vocabulary.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from bench.lossless import PROMPTS, SAMPLINGS, Case, model_drafters, run_case, sampled_drafters
from pipeline.llm.batch import BatchedDecoder
from pipeline.llm.engine import EARLY_EXIT, GenerationRequest, Generator
from pipeline.llm.exact_codes import unavailable_reason
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat

ALPHA = 0.01  # family-wise false-alarm rate of the sampling test (Bonferroni over its cases)
REPLIES = 64  # per case
CONTROL_REPLIES = 192
ROWS = 8  # replies sampled in one batch
GAMMA = 2  # drafts past the outcome's two tokens would not change it
LENGTH = 2
DEVICE = os.environ.get("SPECVOX_LLM__DEVICE", "cpu")  # bench/gpu_check.sh runs these on cuda
ON_CPU = DEVICE == "cpu"


@pytest.fixture(scope="module")
def bundled() -> Generator:
    """The bundled target as the default settings load it (int4-exact where the kernel runs)."""
    return Generator(load_model(LlmOptions(dtype="float32", device=DEVICE)), early_exit_layers=8,
                     prefix_cache_sessions=ROWS)


@pytest.fixture(scope="module")
def prompts(bundled) -> list[list[int]]:
    return [list(bundled.loaded.tokenizer.encode(PROMPTS[0]))]


def ci_drafters(generator) -> list[str]:
    """The engine's drafters and one of them as token trees (the benchmark samples both tree drafters)."""
    return [*generator.drafters, "ngram-tree"]


def ci_grid(drafters: list[str]) -> list[tuple[str, str]]:
    """The suite's share of the drafter × sampling grid (`specvox bench lossless` runs all of it):
    plain sampling at every option, and each drafter at two options half the list apart (a cool
    one with a hot one or a truncated one, so that its drafts meet rejections too), so that every
    option meets a drafter once there are three (about half the cases of the whole grid)."""
    options, drafting = list(SAMPLINGS), [d for d in drafters if d != "none"]
    half = len(options) // 2
    pairs = {(d, options[(i + k) % len(options)]) for i, d in enumerate(drafting) for k in (0, half)}
    return [("none", s) for s in options] + sorted(pairs)


@pytest.fixture(scope="module")
def cases(bundled, prompts) -> list[dict]:
    return [run_case(bundled, prompts, Case(0, drafter, sampling), REPLIES, LENGTH, GAMMA, ROWS)
            for drafter, sampling in ci_grid(ci_drafters(bundled))]


def test_every_drafter_samples_as_the_target_does(bundled, cases):
    threshold = ALPHA / len(cases)
    rejected = [(r["drafter"], r["sampling"], r["p_value"], r["top_outcomes"])
                for r in cases if r["p_value"] < threshold]
    assert not rejected
    assert all(r["impossible"] == 0 for r in cases)
    # the test has something to reject: several bins in every case, drafts accepted and rejected
    assert all(r["bins"] >= 2 for r in cases), [(r["drafter"], r["sampling"], r["bins"]) for r in cases]
    tally = {d: (sum(r["drafted"] for r in cases if r["drafter"] == d),
                 sum(r["accepted"] for r in cases if r["drafter"] == d)) for d in ci_drafters(bundled)[1:]}
    assert all(accepted < drafted for drafted, accepted in tally.values()), tally  # every drafter had rejections
    # and acceptances, but the early exit (8 of 30 layers), whose drafts this prompt seldom takes
    assert all(accepted for d, (_, accepted) in tally.items() if d != "early-exit"), tally


@pytest.mark.parametrize("control", ["temperature", "rule"])
def test_the_negative_controls_are_rejected(bundled, prompts, cases, control):
    drafter = "none" if control == "temperature" else model_drafters(bundled)[0]
    row = run_case(bundled, prompts, Case(0, drafter, "t1.0", control), CONTROL_REPLIES, LENGTH, GAMMA, ROWS)
    assert row["p_value"] < ALPHA / len(cases), row


# --- Greedy: plain decoding's tokens in a batch of any size and in every weight form -------------

GREEDY_TOKENS = 24


def chat(generator: Generator, text: str) -> tuple[int, ...]:
    return tuple(encode_chat(generator.loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))


def greedy_prompts(generator: Generator) -> list[tuple[int, ...]]:
    texts = load_prompts()
    return [chat(generator, texts["dialogue"][2]), chat(generator, texts["caption"][2])]


def alone(generator: Generator, request: GenerationRequest) -> list[int]:
    return [t for step in generator.steps(request) for t in step.token_ids]


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_greedy_in_a_batch_of_any_size_is_plain_decoding(bundled, rows):
    """Every drafter on two prompts, ten requests through a batch of `rows` rows, against plain
    decoding of each prompt alone."""
    prompts = greedy_prompts(bundled)
    plain = {p: alone(bundled, GenerationRequest(p, GREEDY_TOKENS)) for p in prompts}
    requests = [GenerationRequest(p, GREEDY_TOKENS, d) for d in bundled.drafters for p in prompts]
    decoder = BatchedDecoder(bundled, rows, max_verify_tokens=None)
    outputs: dict[int, list[int]] = {}
    waiting = list(enumerate(requests))
    index: dict[int, int] = {}
    while waiting or decoder.rows:
        while waiting and decoder.room:
            i, request = waiting.pop(0)
            index[id(decoder.add(request))] = i
            outputs[i] = []
        for row, step in decoder.step():
            outputs[index[id(row)]].extend(step.token_ids)
    for i, request in enumerate(requests):
        assert outputs[i] == plain[request.prompt_ids], request.drafter
    assert max(decoder.counters.widths) == min(rows, len(requests))


CPU_ONLY = pytest.mark.skipif(not ON_CPU, reason="a weight form of CPU kernels")
WEIGHT_FORMS = [
    pytest.param("dense", "float32", id="dense-float32"),
    pytest.param("int4-exact", "float32", id="int4-exact-float32", marks=[CPU_ONLY, pytest.mark.skipif(
        unavailable_reason() is not None, reason=str(unavailable_reason()))]),
    pytest.param("int4-q8", "float32", id="int4-q8-float32", marks=[CPU_ONLY, pytest.mark.skipif(
        unavailable_reason() is not None, reason=str(unavailable_reason()))]),
    pytest.param("int4", "bfloat16", id="int4-bfloat16", marks=CPU_ONLY),
]


@pytest.mark.parametrize(("weights", "dtype"), WEIGHT_FORMS)
def test_greedy_with_every_drafter_is_plain_decoding_in_every_weight_form(bundled, weights, dtype):
    if weights == bundled.loaded.weights and dtype == "float32":
        generator = bundled
    else:
        loaded = load_model(LlmOptions(dtype=dtype, weights=weights, device=DEVICE))
        assert loaded.weights == weights
        generator = Generator(loaded, early_exit_layers=8)
    drafted = dict.fromkeys(generator.drafters, 0)
    accepted = dict.fromkeys(generator.drafters, 0)
    for prompt in greedy_prompts(generator):
        plain = alone(generator, GenerationRequest(prompt, GREEDY_TOKENS))
        for drafter in generator.drafters[1:]:
            request = GenerationRequest(prompt, GREEDY_TOKENS, drafter, adaptive_draft=False, max_draft_tokens=4)
            assert alone(generator, request) == plain, (weights, drafter)
            drafted[drafter] += generator.last_stats.drafted_tokens
            accepted[drafter] += generator.last_stats.accepted_draft_tokens
    assert all(drafted[d] for d in generator.drafters[1:]), f"a drafter never drafted: {drafted}"
    # Every drafter's rejections were verified; acceptances too, but for the early exit: the bundled
    # target's first 8 layers agree with all 30 on ~4% of positions (it was not trained to exit
    # early, unlike LayerSkip's models), so a 24-token reply may accept none of its drafts.
    assert all(accepted[d] for d in generator.drafters[1:] if d != EARLY_EXIT), f"none accepted: {accepted}"


def test_the_cases_cover_every_sampling_option_and_drafter(bundled, cases):
    """Guard against a shrinking test: every option the issue names, every drafter the engine has."""
    assert {r["sampling"] for r in cases} == set(SAMPLINGS)
    assert {r["drafter"] for r in cases} == set(ci_drafters(bundled))
    assert set(ci_drafters(bundled)) <= set(sampled_drafters(bundled))
    assert {r["sampling"] for r in cases if r["drafter"] != "none"} == set(SAMPLINGS)
    for drafter in ci_drafters(bundled)[1:]:
        assert len({r["sampling"] for r in cases if r["drafter"] == drafter}) == 2, drafter
    assert {dataclasses.astuple(o)[:3] for o in SAMPLINGS.values()} >= {(0.3, 0, 1.0), (1.5, 0, 1.0)}


def test_the_g_test_counts_a_reply_that_ends_where_others_go_on_once():
    """(1, 2) is both an outcome (replies that end after two tokens) and a prefix (of (1, 2, 3)
    and others): counts exactly at expectation give G = 0 (no bin expects mass another bin
    holds), and moving replies from one branch to another is caught. (The G-test once took such a tuple's
    outcome mass for its prefix's, expecting 1,090 replies of 1,000 in a run of the benchmark.)"""
    from collections import Counter

    from bench import lossless

    probs = {(1, 2): 0.3, (1, 2, 3): 0.2, **{(1, 2, 10 + i): 0.004 for i in range(10)},
             **{(1, 5, 30 + i): 0.003 for i in range(20)},
             **{(1, 40 + i, 7): 0.002 for i in range(25)},  # under (1,), in no deeper bin
             **{(2, 7, 100 + i): 0.004 for i in range(85)}, (3,): 0.01}
    prefix_mass = {(1,): 0.65, (2,): 0.34, (1, 2): 0.54, (1, 5): 0.06, (2, 7): 0.34,
                   **{(1, 40 + i): 0.002 for i in range(25)}}
    n = 1000
    exact = Counter({o: round(p * n) for o, p in probs.items()})
    assert sum(exact.values()) == n
    saved = dict(lossless.PREFIX_MASS)
    try:
        lossless.PREFIX_MASS.clear()
        lossless.PREFIX_MASS.update(prefix_mass)
        at_expectation = lossless.g_test(exact, probs)
        shifted = exact.copy()
        shifted[(1, 2, 3)] -= 60
        for i in range(60):
            shifted[(2, 7, 100 + i)] += 1
        moved = lossless.g_test(shifted, probs)
    finally:
        lossless.PREFIX_MASS.clear()
        lossless.PREFIX_MASS.update(saved)
    assert abs(at_expectation.g) < 1e-6 and at_expectation.p_value > 0.99
    assert moved.p_value < 1e-4
