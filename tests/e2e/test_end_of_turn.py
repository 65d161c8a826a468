"""The text end-of-turn scorer: normalisation, its arithmetic, and what it says on the bundled model."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from pipeline.llm.end_of_turn import EndOfTurnScorer, normalise
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions
from pipeline.llm.prompts import Exchange
from tests.conftest import llm_on_loopback
from tests.grpc_status import expect_status

HI = Exchange("Hi.", "Hello! How can I help?")


@contextlib.asynccontextmanager
async def llm_with_a_session(redis_url: str, tiny_llm_dir, persona: str) -> AsyncIterator[tuple[Any, str]]:
    """The llm service on loopback (the tiny model, float64) and a session of `persona` with one exchange, HI."""
    async with llm_on_loopback(redis_url, LlmOptions(model=str(tiny_llm_dir), dtype="float64")) as service:
        session = await service.redis.sessions.create(persona)
        await service.redis.sessions.append(session, HI)
        yield service, session


# A sentence cut where a speaker might pause, and the same sentence complete. Written for this
# test, not tuned to pass: the assertions ask for an ordering over most pairs, not values.
PAIRS = [
    ("Hello, can you tell me", "Hello, can you tell me the time?"),
    ("I was wondering,", "I was wondering if you could help me."),
    ("What is the capital", "What is the capital of Spain?"),
    ("My name is", "My name is Anna."),
    ("Could you please", "Could you please turn on the lights?"),
    ("When does the", "When does the train leave?"),
    ("I'd like to order a pizza with", "I'd like to order a pizza with mushrooms."),
    ("Do you know where", "Do you know where my keys are?"),
    ("So, um,", "So, um, what should I cook tonight?"),
    ("I need apples, oranges,", "I need apples, oranges, and bananas."),
]


def test_normalise():
    assert normalise("  Hello,  can you tell me... ", "strip") == "Hello, can you tell me"
    assert normalise("What time is it?", "marks") == "What time is it"
    assert normalise("Hello, can you — ", "marks") == "Hello, can you"
    assert normalise("Don't STOP, well-known!", "lower") == "don't stop well-known"
    assert normalise(" Hello, there. ", "raw") == "Hello, there."
    with pytest.raises(ValueError, match="normalisation"):
        normalise("x", "nope")


@pytest.fixture(scope="module")
def scorer():
    return EndOfTurnScorer(load_model(LlmOptions()))


def test_complete_sentences_score_above_their_cut_versions(scorer):
    gaps = []
    for cut, complete in PAIRS:
        p_cut, p_complete = scorer.probability(cut), scorer.probability(complete)
        assert 0.0 <= p_cut <= 1.0 and 0.0 <= p_complete <= 1.0
        gaps.append(math.log(p_complete) - math.log(p_cut))
    ordered = sum(g > 0 for g in gaps)
    assert ordered >= len(PAIRS) - 2, gaps
    assert sum(gaps) / len(gaps) > math.log(10), gaps  # complete ones at least 10x likelier on average


def test_whisper_punctuation_at_a_pause_does_not_make_it_complete(scorer):
    """`marks` strips the trailing mark: "Tell me about." (a pause whisper punctuated) stays low."""
    assert scorer.probability("Tell me about.") < scorer.probability("Tell me about the history of Rome.")
    # A question whose "?" whisper left out scores as the question does (the marks are summed over).
    assert scorer.probability("Where is the station") == pytest.approx(scorer.probability("Where is the station?"))


def test_history_is_in_the_prompt_and_bounded(scorer):
    history = (Exchange("Hi.", "Hello! How can I help you today?"),)
    plain = scorer.score("Can you tell me the time?")
    with_history = scorer.score("Can you tell me the time?", history=history)
    assert with_history.prompt_tokens > plain.prompt_tokens
    assert with_history.compute_ms > 0
    long = tuple(Exchange(f"Question {i}?", "A long answer. " * 20) for i in range(5))
    bounded = scorer.score("Can you tell me the time?", history=long)
    assert bounded.prompt_tokens - plain.prompt_tokens <= scorer.max_history_tokens


@pytest.fixture(scope="module")
def tiny_models(tiny_llm_dir):
    options = dict(model=str(tiny_llm_dir), dtype="float64")
    return load_model(LlmOptions(**options)), load_model(LlmOptions(lean_forward=False, **options))


def test_marks_fold_matches_separate_passes(tiny_models):
    """P(end | s) + Σ_m P(m | s) P(end | s + m), computed from the cached batched step, equals full passes."""
    for loaded in tiny_models:
        scorer = EndOfTurnScorer(loaded)
        text = "Hello, can you tell me the time"
        ids = scorer.prompt_ids(text, "Be brief.", ())

        first = _next_logprobs(loaded, ids)
        expected = math.exp(first[scorer.end_id])
        for mark in scorer.mark_ids:
            expected += math.exp(first[mark] + _next_logprobs(loaded, [*ids, mark])[scorer.end_id])
        assert scorer.score(text + "?", "Be brief.", normalisation="marks").probability == pytest.approx(
            expected, rel=1e-9)
        lowered = scorer.prompt_ids(normalise(text + "?"), "Be brief.", ())  # the default, lower-marks: the same fold
        expected = math.exp(_next_logprobs(loaded, lowered)[scorer.end_id]) + sum(
            math.exp(_next_logprobs(loaded, lowered)[m] + _next_logprobs(loaded, [*lowered, m])[scorer.end_id])
            for m in scorer.mark_ids)
        assert scorer.score(text + "?", "Be brief.").probability == pytest.approx(expected, rel=1e-9)
        assert scorer.score(text, "Be brief.", normalisation="strip").probability == pytest.approx(
            math.exp(first[scorer.end_id]), rel=1e-9)


def _next_logprobs(loaded, sequence: list[int]) -> torch.Tensor:
    """Next-token log probabilities after `sequence`, from one full pass of transformers' model, no cache."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([sequence])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


async def test_the_llm_service_scores_the_sessions_conversation_beside_a_reply(redis_url, tiny_llm_dir):
    """EndOfTurn reads the session's prompt and history, runs on the model thread while a reply decodes
    (the batch scheduler's thread too), and says INVALID_ARGUMENT / NOT_FOUND for bad requests."""
    import asyncio

    import grpc

    from services.protos import load

    llm, _ = load("llm")
    history = (HI,)
    async with llm_with_a_session(redis_url, tiny_llm_dir, "Be brief.") as (service, session):
        redis, stub = service.redis, service.stub
        turn = await redis.turns.create(session)
        reply = stub.Reply(llm.ReplyRequest(session_id=session, turn_id=turn, user_text="Tell me a story.",
                                            max_new_tokens=24, defer_history=True))
        scores = await asyncio.gather(
            *(stub.EndOfTurn(llm.EndOfTurnRequest(session_id=session, user_text=t))
              for t in ("Can you tell me", "Can you tell me the time?")),
            stub.EndOfTurn(llm.EndOfTurnRequest(session_id=session, user_text="Hi", system_prompt="Other.")))
        steps = [step async for step in reply]
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "",
                            stub.EndOfTurn(llm.EndOfTurnRequest(session_id=session, user_text="  ")))
        await expect_status(grpc.StatusCode.NOT_FOUND, "",
                            stub.EndOfTurn(llm.EndOfTurnRequest(session_id="nope", user_text="Hello")))
    loaded = service.loaded
    assert steps[-1].end
    scorer = EndOfTurnScorer(loaded)
    for score, (text, persona) in zip(scores, [("Can you tell me", "Be brief."),
                                               ("Can you tell me the time?", "Be brief."), ("Hi", "Other.")],
                                      strict=True):
        expected = scorer.score(text, persona, history)
        assert score.probability == pytest.approx(expected.probability, rel=1e-5)  # a float on the wire
        assert score.prompt_tokens == expected.prompt_tokens and score.compute_ms > 0


async def test_a_reply_asked_beside_its_score_waits_for_it_and_reuses_its_prefill(redis_url, tiny_llm_dir):
    """The gateway asks a turn's score and queues its reply at once: the llm runs the score first
    and the reply's prefill then starts from the conversation the score left in the prefix cache."""
    import asyncio

    from services.protos import load

    llm, _ = load("llm")
    async with llm_with_a_session(redis_url, tiny_llm_dir, "Be brief.") as (service, session):
        redis, stub = service.redis, service.stub
        turn = await redis.turns.create(session)
        text = "What is the capital of Spain?"
        history, calls = service.servicer.sessions.history, []

        async def slow_history(session_id: str):  # the score's read (the first) takes a while: a loaded Redis
            calls.append(session_id)
            await asyncio.sleep(0.3 if len(calls) == 1 else 0)
            return await history(session_id)

        service.servicer.sessions.history = slow_history
        cache = service.servicer.generator.prefix_cache
        reusable, planned_while_scoring = cache.reusable, []

        def watched(key, prompt):  # the reply's plan weighs its prefill by what is cached
            planned_while_scoring.append(key in service.servicer._scoring)
            return reusable(key, prompt)

        cache.reusable = watched
        score = asyncio.ensure_future(stub.EndOfTurn(llm.EndOfTurnRequest(session_id=session, user_text=text)))
        await asyncio.sleep(0)  # the score's call goes out first, as the gateway's does
        steps = [s async for s in stub.Reply(llm.ReplyRequest(session_id=session, turn_id=turn, user_text=text,
                                                              max_new_tokens=8, defer_history=True))]
        scored = await score
    # A new session: nothing of it was cached before the score, which left all of the conversation
    # before the user's (lower-cased) words.
    assert steps[0].prefix_cached_tokens > 0 and scored.prompt_tokens > steps[0].prefix_cached_tokens
    assert planned_while_scoring and not any(planned_while_scoring)  # the plan came after the score
    assert not service.servicer._scoring  # nothing left behind


async def test_prepare_prefills_the_conversation_so_the_first_score_reads_only_the_users_words(
        redis_url, tiny_llm_dir):
    """Prepare leaves the session's persona and history in the prefix cache up to where the user's
    words go; the score after it equals a score without it; unknown sessions are NOT_FOUND."""
    import grpc

    from pipeline.llm.prompts import DEFAULT_PERSONA, Task, chat_messages, encode_chat
    from services.protos import load

    llm, _ = load("llm")
    history = (HI,)
    async with llm_with_a_session(redis_url, tiny_llm_dir, "") as (service, session):
        stub = service.stub
        prepared = await stub.Prepare(llm.PrepareRequest(session_id=session))
        loaded, cache = service.servicer.loaded, service.servicer.generator.prefix_cache
        text = "What is the capital of Spain?"
        reply_prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text, DEFAULT_PERSONA, history))
        cached = cache.reusable(session, reply_prompt)
        heard = await stub.Prepare(llm.PrepareRequest(session_id=session, user_text="What is the capital"))
        cached_with_words = cache.reusable(session, reply_prompt)
        score = await stub.EndOfTurn(llm.EndOfTurnRequest(session_id=session, user_text=text))
        await expect_status(grpc.StatusCode.NOT_FOUND, "", stub.Prepare(llm.PrepareRequest(session_id="nope")))
    user_tokens = len(loaded.tokenizer.encode(text, add_special_tokens=False))
    assert prepared.prompt_tokens > 0 and prepared.compute_ms > 0
    assert len(reply_prompt) - user_tokens - 8 <= cached <= len(reply_prompt) - user_tokens  # all but the words
    # the words heard while the user spoke: for the reply as written, for the score lower-cased
    assert not heard.skipped and heard.prompt_tokens == cached_with_words
    assert cached_with_words == cached + len(loaded.tokenizer.encode("What is the capital", add_special_tokens=False))
    assert score.cached_tokens >= score.prompt_tokens - 4  # " of spain", and the last token again
    expected = EndOfTurnScorer(loaded).score(text, DEFAULT_PERSONA, history)
    assert score.probability == pytest.approx(expected.probability, rel=1e-3)


def test_a_score_on_the_sessions_prefix_cache_leaves_the_conversation_for_the_reply(scorer):
    """With the generator's prefix cache, the score prefills only the new words, and the reply
    that follows finds all of the conversation but the template's tail cached; the reply is the
    one decoded without any of that."""
    from pipeline.llm.engine import GenerationRequest, Generator
    from pipeline.llm.prompts import DEFAULT_PERSONA, Task, chat_messages, encode_chat

    loaded = scorer.loaded
    history = (Exchange("Hi there!", "Hello! How can I help you today?"),)
    text = "What is the capital of Spain?"
    plain = scorer.score(text, DEFAULT_PERSONA, history)
    cached_generator = Generator(loaded, prefix_cache_sessions=4)
    cached = scorer.score(text, DEFAULT_PERSONA, history, prefix_cache=cached_generator.prefix_cache,
                          session_key="s")
    assert cached.probability == pytest.approx(plain.probability, rel=1e-3)
    prompt = tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text, DEFAULT_PERSONA, history)))
    reused = cached_generator.prefix_cache.reusable("s", prompt)
    # The score read the user's text lower-cased (lower-marks): the reply reuses the conversation
    # before it, and prefills the user's own words and the template's tail itself.
    user_tokens = len(loaded.tokenizer.encode(text, add_special_tokens=False))
    assert len(prompt) - user_tokens - 8 <= reused <= len(prompt) - user_tokens
    request = GenerationRequest(prompt, 12, "none", session_key="s")
    with_cache = [t for step in cached_generator.steps(request) for t in step.token_ids]
    without = [t for step in Generator(loaded).steps(GenerationRequest(prompt, 12, "none")) for t in step.token_ids]
    assert with_cache == without


def test_words_prepared_while_the_user_speaks_leave_the_score_and_the_reply_only_the_last_ones(scorer):
    """`prepare` with the words heard so far prefills them as the score reads them and as the reply's
    prompt has them: at the end of the turn the score prefills only the words said since, and
    scores what it would have without; the reply finds all but the last words and the tail
    cached, and decodes what it would have without."""
    from pipeline.llm.engine import GenerationRequest, Generator
    from pipeline.llm.prompts import DEFAULT_PERSONA, Task, chat_messages, encode_chat

    loaded = scorer.loaded
    history = (HI,)
    heard, text = "What is the capital", "What is the capital of Spain?"
    generator = Generator(loaded, prefix_cache_sessions=4)
    cache = generator.prefix_cache
    scorer.prepare(DEFAULT_PERSONA, history, cache, "s")  # at the stream's start
    assert scorer.prepare(DEFAULT_PERSONA, history, cache, "s", user_text="What is").words  # partials
    assert scorer.prepare(DEFAULT_PERSONA, history, cache, "s", user_text=heard).words
    scored = scorer.score(text, DEFAULT_PERSONA, history, prefix_cache=cache, session_key="s")
    plain = scorer.score(text, DEFAULT_PERSONA, history)
    assert scored.probability == pytest.approx(plain.probability, rel=1e-3)
    said_since = len(loaded.tokenizer.encode(" of spain", add_special_tokens=False))
    assert scored.cached_tokens >= scored.prompt_tokens - said_since - 1
    prompt = tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text, DEFAULT_PERSONA, history)))
    heard_prefix = scorer.prompt_ids(heard, DEFAULT_PERSONA, history)
    assert cache.reusable("s", prompt) >= len(heard_prefix) - 1  # the reply's words as written
    request = GenerationRequest(prompt, 12, "none", session_key="s")
    with_cache = [t for step in generator.steps(request) for t in step.token_ids]
    without = [t for step in Generator(loaded).steps(GenerationRequest(prompt, 12, "none")) for t in step.token_ids]
    assert with_cache == without
    # The reply is cached now but not yet in the history (it is still playing): the next words wait.
    held = cache.reusable("s", (*prompt, *with_cache, 0))
    assert held >= len(prompt) + len(with_cache) - 1
    assert not scorer.prepare(DEFAULT_PERSONA, history, cache, "s", user_text="And France").words
    assert cache.reusable("s", (*prompt, *with_cache, 0)) == held


async def test_the_users_words_are_not_prepared_while_a_reply_decodes(redis_url, tiny_llm_dir):
    """Prefilling words heard so far is spare-time work: with a reply decoding it is skipped."""
    import asyncio

    from services.protos import load

    llm, _ = load("llm")
    async with llm_with_a_session(redis_url, tiny_llm_dir, "Be brief.") as (service, session):
        stub = service.stub
        turn = await service.redis.turns.create(session)
        reply = stub.Reply(llm.ReplyRequest(session_id=session, turn_id=turn, user_text="Tell me a long story.",
                                            max_new_tokens=400, defer_history=True))
        other = await service.redis.sessions.create("Be brief.")  # another user, speaking meanwhile
        first = await reply.read()
        during = await stub.Prepare(llm.PrepareRequest(session_id=other, user_text="And then"))
        reply.cancel()
        assert service.servicer.scheduler is not None
        while service.servicer.scheduler.busy:  # the cancelled row leaves at its next step
            await asyncio.sleep(0.01)
        after = await stub.Prepare(llm.PrepareRequest(session_id=other, user_text="And then"))
    assert first.seq == 0 and during.skipped and during.prompt_tokens == 0
    assert not after.skipped and after.prompt_tokens > 0


async def test_words_whose_turn_comes_after_a_reply_began_are_skipped(redis_url, tiny_llm_dir):
    """A Prepare of words that waited for the model thread while a reply was queued finds the reply
    decoding when its turn comes: it skips (the reply holds the session's prefix) rather than
    prefill the whole conversation again between the reply's steps."""
    import asyncio
    import threading

    from services.protos import load

    llm, _ = load("llm")
    async with llm_with_a_session(redis_url, tiny_llm_dir, "Be brief.") as (service, session):
        stub, servicer = service.stub, service.servicer
        release = threading.Event()
        holding = asyncio.ensure_future(servicer.worker.call(release.wait))  # the thread busy with other work
        await asyncio.sleep(0.05)
        assert servicer.scheduler is not None and not servicer.scheduler.busy
        words = asyncio.ensure_future(stub.Prepare(llm.PrepareRequest(session_id=session, user_text="And then")))
        await asyncio.sleep(0.3)  # queued behind the held thread, no reply yet
        turn = await service.redis.turns.create(session)
        reply = stub.Reply(llm.ReplyRequest(session_id=session, turn_id=turn, user_text="Tell me a long story.",
                                            max_new_tokens=200, defer_history=True))
        first = asyncio.ensure_future(reply.read())
        for _ in range(200):  # until the reply has joined the scheduler
            if servicer.scheduler.busy:
                break
            await asyncio.sleep(0.01)
        release.set()
        prepared = await words
        await first
        reply.cancel()
        await holding
    assert prepared.skipped and prepared.prompt_tokens == 0
