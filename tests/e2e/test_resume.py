"""Resuming a reply from its accepted tokens (issue 13): a worker that takes over a turn
re-prefills prompt + the tokens its log holds and goes on as if nothing had happened.

On the bundled target in each float32 weight form (dense, and int4-exact where the kernel
runs) and on the small Llama in bfloat16 with 4-bit weights: the replayed cache is bit for
bit plain decoding's; a greedy reply resumed at any cut equals the uninterrupted one, token
for token and text for text, with every drafter, alone and in a batch, on a worker without
the session's prefix cache; a seeded sampled reply too. The per-position random state keeps
sampling exact in distribution (the point-mass coupling, the draft for the last position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pipeline.llm.batch import BatchedDecoder
from pipeline.llm.detokenize import IncrementalDetokenizer
from pipeline.llm.engine import DecodeStep, GenerationRequest, Generator, RequestDecoder
from pipeline.llm.exact_codes import unavailable_reason
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions, SamplingOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Exchange, Task, chat_messages, encode_chat
from pipeline.llm.sampling import PositionalRandom, logits_to_probs, position_seed, speculative_verify
from tests.conftest import with_a_perturbed_draft

PROMPTS = load_prompts()
TEXTS = (PROMPTS["dialogue"][0], PROMPTS["caption"][0])
MAX_NEW = 24
DRAFTERS = ("none", "ngram", "suffix", "early-exit", "quantized")
FORMS = ("dense", pytest.param("int4-exact", marks=pytest.mark.skipif(
    unavailable_reason() is not None, reason=str(unavailable_reason()))))
DEFAULT_FORM = "int4-exact" if unavailable_reason() is None else "dense"  # what llm.weights=auto loads here
SAMPLINGS = [SamplingOptions(temperature=0.7, seed=11), SamplingOptions(temperature=1.0, top_p=0.9, seed=12)]
FALSE_ALARM = 1e-3


@pytest.fixture(scope="module", params=FORMS)
def bundled(request) -> Generator:
    loaded = load_model(LlmOptions(dtype="float32", weights=request.param))
    assert loaded.weights == request.param
    return Generator(loaded, early_exit_layers=8)


@pytest.fixture(scope="module")
def tiny_int4(tiny_llm_dir) -> Generator:
    """The 16-bit configuration: bfloat16 activations, 4-bit weights, verification row by row;
    with a draft model (the same weights, perturbed) for the `draft` drafter."""
    options = LlmOptions(model=str(tiny_llm_dir), dtype="bfloat16", weights="int4")
    return with_a_perturbed_draft(options, dataclasses.replace(options, weights="dense"))


def encode(generator: Generator, text: str, history: tuple[Exchange, ...] = ()) -> tuple[int, ...]:
    return tuple(encode_chat(generator.loaded.tokenizer, chat_messages(Task.DIALOGUE, text, history=history)))


def steps_of(generator: Generator, request: GenerationRequest) -> list[DecodeStep]:
    return list(generator.steps(request))


def tokens(steps: Sequence[DecodeStep]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


def text(steps: Sequence[DecodeStep]) -> str:
    return "".join(s.text_delta for s in steps)


def cuts(n: int) -> list[int]:
    return sorted({0, 1, n // 2, n - 1})


def resume(request: GenerationRequest, full: Sequence[DecodeStep], cut: int) -> GenerationRequest:
    """The request continued after the reply's first `cut` tokens, numbered after the steps
    that hold them (a cut inside a step: the log would have had that step whole; any number fits)."""
    held = sum(1 for s in full if s.offset < cut)
    return request.resumed(tokens(full)[:cut], held)


def assert_resumes(generator: Generator, request: GenerationRequest, full: list[DecodeStep], cut: int) -> None:
    """Resumed at `cut`, the reply goes on as the uninterrupted one did: the same tokens, the
    same text from the point the log's text had reached, the same end, consecutive numbering."""
    later = resume(request, full, cut)
    resumed = steps_of(generator, later)
    label = f"{request.drafter} cut at {cut}"
    assert tokens(resumed) == tokens(full)[cut:], label
    emitted = IncrementalDetokenizer(generator.loaded.tokenizer, primed=tokens(full)[:cut]).text
    assert emitted + text(resumed) == text(full), label
    assert resumed[-1].finish_reason == full[-1].finish_reason, label
    assert [s.seq for s in resumed] == list(range(later.resume_seq, later.resume_seq + len(resumed))), label
    assert resumed[0].offset == cut and all(b.offset == a.offset + a.accepted
                                            for a, b in zip(resumed, resumed[1:], strict=False)), label
    assert resumed[-1].stats is not None and resumed[-1].stats.resumed_tokens == cut
    if request.drafter == "none":  # one token a step: the very steps of the uninterrupted reply
        assert [(s.token_ids, s.text_delta, s.finish_reason) for s in resumed] == \
            [(s.token_ids, s.text_delta, s.finish_reason) for s in full[cut:]], label


# --- The replay: the resumed tokens' cache is plain decoding's, bit for bit -----------------

def plain_logits(generator: Generator, prompt: Sequence[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding through the generator's forward: the tokens and each step's logits."""
    forward, device = generator.forward, generator.loaded.device
    with torch.inference_mode():
        cache = forward(input_ids=torch.tensor([prompt[:-1]], device=device), cache=None, use_cache=True,
                        logits_to_keep=1).cache
        out, rows, last = [], [], prompt[-1]
        for _ in range(n):
            result = forward(input_ids=torch.tensor([[last]], device=device), cache=cache, use_cache=True,
                             logits_to_keep=1)
            cache, row = result.cache, result.logits[0, -1].clone()
            last = int(row.argmax())
            out.append(last)
            rows.append(row)
    return out, rows


def assert_replay_is_plain_decoding(generator: Generator) -> None:
    prompt = encode(generator, TEXTS[0])
    reply, rows = plain_logits(generator, prompt, MAX_NEW)
    for cut in (1, 5, MAX_NEW - 1):
        decoder = RequestDecoder(generator, GenerationRequest(prompt, MAX_NEW).resumed(reply[:cut], 1))
        with torch.inference_mode():
            cache = generator.prefill(decoder)
            logits = generator.forward(input_ids=torch.tensor([[reply[cut - 1]]]), cache=cache, use_cache=True,
                                       logits_to_keep=1).logits[0, -1]
        assert torch.equal(logits, rows[cut]), f"cut at {cut}: {float((logits - rows[cut]).abs().max()):.2e}"


def test_the_replayed_cache_is_plain_decodings_bit_for_bit(bundled):
    # the int4-exact kernel: row-invariant products; dense float32 (MKL's packed product rounds a
    # row by the rows beside it on some CPUs): a token a pass
    assert bundled.exact_rows == (16 if bundled.loaded.weights == "int4-exact" else 1)
    assert_replay_is_plain_decoding(bundled)


def test_the_replayed_cache_is_plain_decodings_in_bfloat16_int4(tiny_int4):
    assert tiny_int4.exact_rows == 16
    assert_replay_is_plain_decoding(tiny_int4)


def test_one_token_replay_where_the_products_are_not_row_invariant(tiny_llm_dir):
    """float32 through torch's plain product (no MKL packing): each resumed token gets a pass of its own."""
    generator = Generator(load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float32", weights="dense",
                                                pack_weights=False)))
    assert generator.exact_rows == 1
    assert_replay_is_plain_decoding(generator)


# --- Greedy: the resumed reply is the uninterrupted one ------------------------------------

# Dense float32 replays a token a pass (its products are not row-invariant), so the suite's share
# there is plain decoding, a model-free drafter and a model drafter; int4-exact takes every drafter.
DENSE_DRAFTERS = ("none", "suffix", "quantized")


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_greedy_reply_resumed_at_any_cut_is_the_uninterrupted_reply(bundled, drafter):
    if bundled.loaded.weights == "dense" and drafter not in DENSE_DRAFTERS:
        pytest.skip("dense float32 resumes with a share of the drafters; int4-exact with each")
    plain = tokens(steps_of(bundled, GenerationRequest(encode(bundled, TEXTS[0]), MAX_NEW)))
    for text_ in TEXTS:
        request = GenerationRequest(encode(bundled, text_), MAX_NEW, drafter)
        full = steps_of(bundled, request)
        if text_ == TEXTS[0]:
            assert tokens(full) == plain, drafter
        for cut in cuts(len(tokens(full))):
            assert_resumes(bundled, request, full, cut)


@pytest.mark.parametrize("drafter", ("none", "ngram", "suffix", "early-exit", "draft"))
def test_a_greedy_reply_resumed_in_bfloat16_int4(tiny_int4, drafter):
    request = GenerationRequest(encode(tiny_int4, TEXTS[1]), MAX_NEW, drafter)
    full = steps_of(tiny_int4, request)
    for cut in cuts(len(tokens(full))):
        assert_resumes(tiny_int4, request, full, cut)


def test_a_resumed_row_in_a_batch_is_the_uninterrupted_reply(bundled):
    prompts = [encode(bundled, t) for t in TEXTS]
    requests = [GenerationRequest(p, MAX_NEW, "ngram") for p in prompts]
    fulls = [steps_of(bundled, r) for r in requests]
    later = [resume(r, f, len(tokens(f)) // 2) for r, f in zip(requests, fulls, strict=True)]
    decoder = BatchedDecoder(bundled, max_batch_size=4)
    out: dict[int, list[DecodeStep]] = {}
    rows = {id(decoder.add(r)): i for i, r in enumerate([requests[0], later[1]])}
    while decoder.rows:
        for row, step in decoder.step():
            out.setdefault(rows[id(row)], []).append(step)
    assert tokens(out[0]) == tokens(fulls[0])
    assert tokens(out[1]) == tokens(fulls[1])[len(later[1].resume_tokens):]
    assert out[1][0].seq == later[1].resume_seq


def test_a_resume_on_a_worker_without_the_sessions_prefix_cache(bundled):
    """The reply was decoded on the session's cached prefix (the turn before); the worker that
    resumes it has no cache and prefills the whole prompt: the same reply."""
    worker = Generator(bundled.loaded, prefix_cache_sessions=4)
    first = GenerationRequest(encode(worker, TEXTS[0]), MAX_NEW, "suffix", session_key="s")
    answer = text(steps_of(worker, first))
    request = GenerationRequest(encode(worker, "And what about tomorrow?", (Exchange(TEXTS[0], answer),)),
                                MAX_NEW, "suffix", session_key="s")
    full = steps_of(worker, request)
    assert full[0].prefix_cached_tokens >= len(first.prompt_ids) - 1  # it did run on the cached turn
    other = Generator(bundled.loaded, prefix_cache_sessions=0)
    for cut in (1, len(tokens(full)) // 2):
        assert_resumes(other, request, full, cut)


# --- Seeded sampling ----------------------------------------------------------------------

@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t0.7", "t1.0-top-p0.9"])
def test_a_seeded_reply_resumed_is_the_uninterrupted_reply(bundled, sampling):
    if bundled.loaded.weights != DEFAULT_FORM:
        pytest.skip(f"one float32 form is enough for sampling: the default one, {DEFAULT_FORM}")
    prompt = encode(bundled, TEXTS[0])
    plain = tokens(steps_of(bundled, GenerationRequest(prompt, MAX_NEW, "none", sampling)))
    for drafter in DRAFTERS:
        request = GenerationRequest(prompt, MAX_NEW, drafter, sampling)
        full = steps_of(bundled, request)
        if drafter in ("ngram", "suffix"):  # a point-mass draft leaves the seeded reply as it was
            assert tokens(full) == plain, drafter
        assert_resumes(bundled, request, full, len(tokens(full)) // 2)


@pytest.mark.parametrize("drafter", ("none", "ngram", "early-exit", "draft"))
def test_a_seeded_reply_resumed_in_bfloat16_int4(tiny_int4, drafter):
    """In bfloat16 a drafter's q rounds by the shape of its passes unless its rows are exact
    (through transformers' modules every one of these resumed replies went another way)."""
    prompt = encode(tiny_int4, TEXTS[0])
    for seed in range(3):
        request = GenerationRequest(prompt, MAX_NEW, drafter, dataclasses.replace(SAMPLINGS[1], seed=seed))
        full = steps_of(tiny_int4, request)
        assert_resumes(tiny_int4, request, full, len(tokens(full)) // 2)
        # nor does a seeded reply depend on the draft lengths its steps took
        assert tokens(steps_of(tiny_int4, dataclasses.replace(request, max_draft_tokens=3))) == tokens(full)


def test_the_random_state_of_a_position_depends_on_the_seed_and_the_position_alone():
    random, other = PositionalRandom(5), PositionalRandom(5)
    draws = [float(torch.rand((), generator=random.at(n))) for n in (3, 0, 7, 3)]
    assert draws[0] == draws[3] == float(torch.rand((), generator=other.at(3)))
    assert len({*draws[:3], float(torch.rand((), generator=random.at(3, stream=1)))}) == 4
    assert position_seed(5, 3) != position_seed(6, 3) != position_seed(5, 4)


# The rule with per-position state, in distribution (as tests/e2e/test_speculative.py checks position 0).

def distributions(seed: int = 0, vocab: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(2, vocab, generator=g, dtype=torch.float64) * 2
    draft = target + torch.randn(2, vocab, generator=g, dtype=torch.float64) * 1.5
    options = SamplingOptions(temperature=1.0)
    return logits_to_probs(target, options), logits_to_probs(draft, options)


def assert_distributed_as(counts: np.ndarray, expected: np.ndarray) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], expected[support] * counts.sum()).pvalue > FALSE_ALARM


def test_a_draft_for_the_last_position_keeps_the_target_distribution():
    """Seeded sampling with a model drafter tests a draft at the position past the verified
    ones instead of drawing from p there: the token is still distributed as p."""
    p, q = distributions()
    counts = np.zeros(p.shape[1])
    random = PositionalRandom(1)
    for n in range(40_000):
        x = int(torch.multinomial(q[0], 1, generator=random.at(n, stream=1)))
        accepted, token = speculative_verify([x], p[:1], q[:1], lambda i, n=n: random.at(n + i))
        assert accepted == 0
        counts[token] += 1
    assert_distributed_as(counts, p[0].numpy())


def test_a_point_mass_draft_commits_the_targets_own_draw():
    """One uniform a position: whatever the point-mass draft, the token is F⁻¹_p(u), so it is
    distributed as p and equal to what no draft gives."""
    p, _ = distributions(1)
    counts = np.zeros(p.shape[1])
    random = PositionalRandom(2)
    for n in range(20_000):
        alone = speculative_verify([], p[:1], None, lambda i, n=n: random.at(n + i))[1]
        x = n % p.shape[1]
        accepted, token = speculative_verify([x], p, None, lambda i, n=n: random.at(n + i))
        assert (token if accepted == 0 else x) == alone
        counts[alone] += 1
    assert_distributed_as(counts, p[0].numpy())


# --- Text, limits and the request's checks ------------------------------------------------

def test_the_detokenizer_primed_at_any_cut_goes_on_as_the_uninterrupted_one(tiny_int4):
    tokenizer = tiny_int4.loaded.tokenizer
    ids = tokenizer.encode("Voilà: café 😊 naïve — 東京 ok.")
    whole = IncrementalDetokenizer(tokenizer)
    deltas = [whole.push([t]) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids) and "\ufffd" not in "".join(deltas)
    for cut in range(len(ids) + 1):  # characters of 2, 3 and 4 bytes split across tokens among them
        primed = IncrementalDetokenizer(tokenizer, primed=ids[:cut])
        assert primed.text == "".join(deltas[:cut])
        assert [primed.push([t]) for t in ids[cut:]] == deltas[cut:], cut


def test_a_stop_string_across_the_cut_and_the_token_limit_end_as_uninterrupted(tiny_int4):
    prompt = encode(tiny_int4, TEXTS[0])
    full_text = text(steps_of(tiny_int4, GenerationRequest(prompt, MAX_NEW)))
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 4]
    request = GenerationRequest(prompt, MAX_NEW, "ngram", stop_strings=(stop,))
    full = steps_of(tiny_int4, request)
    assert full[-1].finish_reason == "stop"
    for cut in cuts(len(tokens(full))):
        assert_resumes(tiny_int4, request, full, cut)
    # resumed tokens that already hold the stop string, or the whole token limit: over at once
    for ended, finish in ((request, "stop"), (GenerationRequest(prompt, len(tokens(full))), "length")):
        done = steps_of(tiny_int4, ended.resumed(tokens(full), 3))
        assert [(s.seq, s.token_ids, s.text_delta, s.finish_reason) for s in done] == [(3, (), "", finish)]


def test_a_resumed_request_already_over_leaves_a_batch_with_its_last_step(tiny_int4):
    prompt = encode(tiny_int4, TEXTS[0])
    running = GenerationRequest(prompt, 4)
    full = steps_of(tiny_int4, running)
    decoder = BatchedDecoder(tiny_int4, max_batch_size=2)
    row = decoder.add(running)
    over = decoder.add(GenerationRequest(prompt, 4).resumed(tokens(full), 4))
    first = decoder.step()
    assert [(r is over, s.seq, s.finish_reason) for r, s in first if r is over] == [(True, 4, "length")]
    assert len(decoder.rows) == 1 and decoder.rows[0] is row
    while decoder.rows:
        first += decoder.step()
    assert tokens([s for r, s in first if r is row]) == tokens(full)


def test_resume_requests_that_cannot_be_right_are_refused(tiny_int4):
    prompt = encode(tiny_int4, TEXTS[0])
    eos = min(tiny_int4.loaded.eos_token_ids)
    for resumed, seq, message in (((100, 200), 0, "resume_seq"), ((100, 200), 3, "resume_seq"), ((), 1, "resume_seq"),
                                  ((100, eos), 1, "end-of-sequence"), ((100, 10**9), 1, "vocabulary")):
        with pytest.raises(ValueError, match=message):
            steps_of(tiny_int4, GenerationRequest(prompt, MAX_NEW).resumed(resumed, seq))


def test_the_resumed_request_is_the_original_with_its_log():
    request = GenerationRequest((1, 2, 3), 10, "suffix", session_key="s")
    later = request.resumed([7, 8], 2)
    assert later == dataclasses.replace(request, resume_tokens=(7, 8), resume_seq=2)
