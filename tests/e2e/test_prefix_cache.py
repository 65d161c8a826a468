"""The per-session prefix KV cache: a turn prefills only what the previous turn did not leave cached.

On the bundled target, in the configuration the service runs, a three-turn conversation
decodes to the same tokens with the cache as without it, on both paths (a request alone,
and the batch the service uses by default), and each turn reuses what the previous one left:
its whole prompt and reply. A history that changed (a reply recorded shorter, as when the
user cut it off) reuses only the common prefix. The store is bounded, least recently used
dropped, and the service reports the reuse on a reply's first step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from pipeline.llm.batch import BatchedDecoder, BatchScheduler, _Pending
from pipeline.llm.engine import DecodeStep, GenerationRequest, Generator
from pipeline.llm.kv_cache import KVCache
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions
from pipeline.llm.prefix_cache import PrefixCache, cache_nbytes, common_prefix, variant_key
from pipeline.llm.prompts import DEFAULT_PERSONA, Exchange, Task, chat_messages, encode_chat
from services.protos import load
from services.server.model_worker import ModelWorker
from tests.conftest import llm_on_loopback

QUESTIONS = ("What is the capital of France?", "And what about Germany?", "Which of the two cities is bigger?")
MAX_NEW = 24
Run = Callable[[GenerationRequest], list[DecodeStep]]


@pytest.fixture(scope="module")
def loaded():
    return load_model(LlmOptions())


@dataclass
class Turn:
    prompt: tuple[int, ...]
    steps: list[DecodeStep]

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]

    @property
    def cached(self) -> int:
        return self.steps[0].prefix_cached_tokens

    def left_in_cache(self, eos: int) -> list[int]:
        """What the cache holds after the reply: prompt and reply (with its EOS) but the last token."""
        ended = [eos] if self.steps[-1].finish_reason == "eos" else []
        return [*self.prompt, *self.tokens, *ended][:-1]


def encode(tokenizer, question: str, history: tuple[Exchange, ...]) -> tuple[int, ...]:
    return tuple(encode_chat(tokenizer, chat_messages(Task.DIALOGUE, question, DEFAULT_PERSONA, history)))


def converse(run: Run, tokenizer, drafter: str, record: Callable[[str], str] = str.strip) -> list[Turn]:
    """The three questions as one session; `record` is what the history keeps of each reply."""
    history: tuple[Exchange, ...] = ()
    turns = []
    for question in QUESTIONS:
        prompt = encode(tokenizer, question, history)
        steps = run(GenerationRequest(prompt, MAX_NEW, drafter, session_key="session"))
        turns.append(Turn(prompt, steps))
        history += (Exchange(question, record("".join(s.text_delta for s in steps))),)
    return turns


def alone(generator: Generator) -> Run:
    return lambda request: list(generator.steps(request))


def in_a_batch(generator: Generator) -> Run:
    """The request in a BatchedDecoder beside another session's, both run to their end."""
    decoder = BatchedDecoder(generator, max_batch_size=4)
    companion = encode(generator.loaded.tokenizer, "Tell me about bees.", ())

    def run(request: GenerationRequest) -> list[DecodeStep]:
        row = decoder.add(request)
        decoder.add(GenerationRequest(companion, MAX_NEW // 2, request.drafter, session_key="other"))
        steps = []
        while decoder.rows:
            steps += [step for r, step in decoder.step() if r is row]
        return steps

    return run


def test_a_conversation_alone_decodes_the_same_and_reuses_each_previous_turn(loaded):
    eos = min(loaded.eos_token_ids)
    cached = converse(alone(Generator(loaded, prefix_cache_sessions=4)), loaded.tokenizer, "none")
    plain = converse(alone(Generator(loaded)), loaded.tokenizer, "none")
    assert [t.tokens for t in cached] == [t.tokens for t in plain]
    assert [t.prompt for t in cached] == [t.prompt for t in plain]
    assert cached[0].cached == 0 and all(t.cached == 0 for t in plain)
    for before, turn in zip(cached, cached[1:], strict=False):
        expected = min(common_prefix(turn.prompt, before.left_in_cache(eos)), len(turn.prompt) - 1)
        assert turn.cached == expected
        assert turn.cached >= len(before.prompt) + len(before.tokens) - 1  # the previous prompt and reply
    stats = cached[-1].steps[-1].stats
    assert stats is not None and stats.prefix_cached_tokens == cached[-1].cached
    assert stats.prompt_tokens == len(cached[-1].prompt)


def test_a_conversation_in_the_batch_decodes_the_same_with_the_default_drafter(loaded):
    """The service's default path: rows of a BatchedDecoder, the `suffix` drafter."""
    cached = converse(in_a_batch(Generator(loaded, prefix_cache_sessions=4)), loaded.tokenizer, "suffix")
    plain = converse(in_a_batch(Generator(loaded)), loaded.tokenizer, "suffix")
    assert [t.tokens for t in cached] == [t.tokens for t in plain]
    assert cached[0].cached == 0
    for before, turn in zip(cached, cached[1:], strict=False):  # the previous prompt and reply, at least
        assert turn.cached >= len(before.prompt) + len(before.tokens) - 1


def test_a_reply_recorded_shorter_reuses_only_the_common_prefix(loaded):
    """The history keeps the first three words of each reply, as of a reply the user cut off."""
    def cut(text: str) -> str:
        return " ".join(text.split()[:3])

    eos = min(loaded.eos_token_ids)
    cached = converse(alone(Generator(loaded, prefix_cache_sessions=4)), loaded.tokenizer, "none", record=cut)
    plain = converse(alone(Generator(loaded)), loaded.tokenizer, "none", record=cut)
    assert [t.tokens for t in cached] == [t.tokens for t in plain]
    for before, turn in zip(cached, cached[1:], strict=False):
        assert len(before.tokens) > 6, "the reply was too short to cut"
        assert len(before.prompt) <= turn.cached < len(before.prompt) + len(before.tokens) - 1
        assert turn.cached == common_prefix(turn.prompt, before.left_in_cache(eos))


@pytest.fixture(scope="module")
def tiny(tiny_llm_dir):
    return load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float64"))


def test_the_store_keeps_the_most_recently_used_sessions(tiny):
    generator = Generator(tiny, prefix_cache_sessions=2)
    tokenizer = generator.loaded.tokenizer

    def first_step(session: str, question: str) -> DecodeStep:
        request = GenerationRequest(encode(tokenizer, question, ()), 4, session_key=session)
        return list(generator.steps(request))[0]  # run to its end, when the request leaves its cache

    for session in ("a", "b", "c"):
        first_step(session, "Why is the sky blue?")
    assert "a" not in generator.prefix_cache and {"b", "c"} <= set(generator.prefix_cache._entries)
    persona_and_more = first_step("b", "Why is the grass green?").prefix_cached_tokens  # b is now the newest
    assert persona_and_more > 0
    assert first_step("a", "Why is the grass green?").prefix_cached_tokens == 0  # dropped: c goes now
    assert set(generator.prefix_cache._entries) == {"b", "a"}
    assert len(generator.prefix_cache) == 2


def test_a_turn_restarted_in_the_batch_finds_what_its_cancelled_turn_left(tiny):
    """A scheduler tick lets cancelled rows leave before it admits new ones, so a turn restarted on
    the final transcript, in the tick that sees the early one cancelled, joins on the cache it left.
    (Ticks driven one by one: the asyncio loop would decide by timing which tick sees what.)"""
    generator = Generator(tiny, prefix_cache_sessions=4)
    scheduler = BatchScheduler(BatchedDecoder(generator, max_batch_size=4), ModelWorker("test").call)
    early = GenerationRequest(encode(tiny.tokenizer, "Why do cats", ()), 64, session_key="s")
    final = GenerationRequest(encode(tiny.tokenizer, "Why do cats purr?", ()), 8, session_key="s")
    stop = threading.Event()
    scheduler._tick([_Pending(early, stop.is_set, asyncio.Queue())])
    scheduler._tick([])
    stop.set()
    (gone, last), (row, first) = scheduler._tick([_Pending(final, lambda: False, asyncio.Queue())])
    assert gone.request is early and last.finish_reason == "cancelled" and row.request is final
    shared = common_prefix(early.prompt_ids, final.prompt_ids)
    assert shared > 0 and first.prefix_cached_tokens == shared
    steps = [first]
    while scheduler.decoder.rows:
        steps += [step for r, step in scheduler.decoder.step() if r is row]
    reference = list(Generator(tiny).steps(final))
    assert [t for s in steps for t in s.token_ids] == [t for s in reference for t in s.token_ids]


@pytest.mark.parametrize("kind", ("KVCache", "DynamicCache"))
def test_a_taken_cache_is_rolled_back_to_the_common_prefix(kind):
    """The lean pass's preallocated cache and transformers' (a target run through its own modules)."""
    from transformers import DynamicCache

    keys = torch.randn(1, 2, 10, 4)
    if kind == "KVCache":
        cache = KVCache.from_tensors([(keys, keys + 1)])
    else:
        cache = DynamicCache()
        cache.update(keys, keys + 1, 0)
    store = PrefixCache(sessions=1)
    store.put("s", list(range(10)), cache)
    assert store.reusable("s", [0, 1, 2, 3, 9, 9]) == 4
    assert store.reusable("s", list(range(10))) == 9  # the last prompt token is always the first pass's input
    taken, kept = store.take("s", [0, 1, 2, 3, 9, 9])
    assert kept == 4 and taken.get_seq_length() == 4 and torch.equal(taken.layers[0].keys, keys[:, :, :4])
    assert "s" not in store and store.take("s", [0, 1]) == (None, 0)
    with pytest.raises(ValueError, match="positions"):
        store.put("s", [1, 2], taken)
    PrefixCache(sessions=0).put("s", list(range(4)), taken)  # off: keeps nothing, no error


def test_a_variant_starts_from_a_copy_of_its_sessions_prefix_and_leaves_with_the_session():
    """The end-of-turn score keeps the user's words lower-cased beside the reply's as written: it
    starts from the reply's prefix where that shares more, without taking it from the reply."""
    keys = torch.randn(1, 2, 10, 4)
    store = PrefixCache(sessions=1)
    store.put("s", list(range(10)), KVCache.from_tensors([(keys, keys + 1)]))
    scored = variant_key("s", "score")
    taken, kept = store.take(scored, [0, 1, 2, 3, 4, 7, 7], fallback="s")
    assert kept == 5 and torch.equal(taken.layers[0].keys, keys[:, :, :5])
    assert store.reusable("s", list(range(10))) == 9  # the session's own prefix is still whole
    store.put(scored, [0, 1, 2, 3, 4], taken)
    # the variant's own entry, where the session's shares no more
    again, kept = store.take(scored, [0, 1, 2, 3, 4, 8, 8], fallback="s")
    assert kept == 5 and again is taken
    store.put(scored, [0, 1, 2, 3, 4], again)
    assert len(store) == 2  # one session, two prefixes: within the bound of one session
    store.put("t", [1, 2, 3], KVCache.from_tensors([(keys[:, :, :3], keys[:, :, :3])]))
    assert "s" not in store and scored not in store and "t" in store  # the session went whole


async def test_the_service_reports_the_cached_prefix_of_a_sessions_second_reply(redis_url, tiny_llm_dir):
    """Through the gRPC servicer, its default batched path, with a system prompt of the request's own."""
    llm, _ = load("llm")
    persona = "You are a terse pirate."
    async with llm_on_loopback(redis_url, LlmOptions(model=str(tiny_llm_dir), dtype="float64")) as service:
        redis, stub = service.redis, service.stub
        session = await redis.sessions.create("")
        replies = []
        for question in QUESTIONS[:2]:
            request = llm.ReplyRequest(session_id=session, turn_id=await redis.turns.create(session),
                                       user_text=question, max_new_tokens=12, system_prompt=persona)
            replies.append([step async for step in stub.Reply(request)])
        capabilities = await stub.Capabilities(llm.CapabilitiesRequest())
        history = await redis.sessions.history(session)
    settings, loaded = service.settings, service.loaded
    first, second = replies
    assert first[0].prefix_cached_tokens == 0 and second[0].prefix_cached_tokens > 0
    assert all(step.prefix_cached_tokens == 0 for step in second[1:])
    prompt = tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, QUESTIONS[1], persona, history[:1])))
    reference = Generator(loaded).steps(GenerationRequest(prompt, 12, settings.llm.drafter))
    assert [t for s in second for t in s.token_ids] == [t for s in reference for t in s.token_ids]
    first_prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, QUESTIONS[0], persona))
    assert second[0].prefix_cached_tokens >= len(first_prompt)  # the first turn's prompt, with the request's persona
    assert capabilities.default_drafter == settings.llm.drafter and "none" in capabilities.drafters
    assert capabilities.context_tokens == loaded.context_tokens and capabilities.max_new_tokens == 96
    assert capabilities.weights == loaded.weights


def test_the_bytes_kept_are_bounded_least_recently_used_sessions_first():
    """`llm.prefix_cache_mb`: the buffers count as allocated (a KVCache's spare slots too); past the
    bound the oldest sessions go whole, then the newest session's other prefixes; the entry just
    put stays even when it alone is over the bound."""
    def cache(tokens: int) -> KVCache:
        keys = torch.randn(1, 2, tokens, 4)
        return KVCache.from_tensors([(keys, keys)])

    one = cache(10)
    per_entry = cache_nbytes(one)
    assert per_entry == 2 * one.keys.numel() * one.keys.element_size()  # 128 slots allocated, 10 live
    assert per_entry > 2 * 10 * 2 * 4 * 4
    store = PrefixCache(sessions=8, max_bytes=3 * per_entry)
    store.put("a", list(range(10)), one)
    store.put(variant_key("a", "score"), list(range(10)), cache(10))
    store.put("b", list(range(10)), cache(10))
    assert len(store) == 3 and store.nbytes == 3 * per_entry
    store.reusable("a", [0, 1])  # a read does not make "a" recent
    store.put("c", list(range(10)), cache(10))  # over: "a" is the least recent session, both its prefixes go
    assert "a" not in store and variant_key("a", "score") not in store and {"b", "c"} <= set(store._entries)
    assert store.nbytes == 2 * per_entry
    store.put(variant_key("c", "score"), list(range(10)), cache(10))
    store.put("d", list(range(200)), cache(200))  # 1.5 × per_entry (3 chunks against 2)
    assert set(store._entries) == {"d"}  # b, then c's, until d fits
    big = cache(2000)
    store.put("e", list(range(2000)), big)  # alone over the bound: kept, all else dropped
    assert set(store._entries) == {"e"} and store.nbytes == cache_nbytes(big) > store.max_bytes
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        PrefixCache(sessions=1, max_bytes=-1)


def test_a_dynamic_caches_bytes_are_its_layers_tensors():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), 0)
    cache.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), 1)
    assert cache_nbytes(cache) == 4 * 10 * 2 * 4 * 4


def test_the_suffix_memories_of_all_sessions_are_bounded_in_tokens(tiny, monkeypatch):
    """A stack that meets many sessions keeps suffix memories of the latest ones only, up to
    `engine.REMEMBERED_TOKENS` together (a count of sessions let them grow with every new one)."""
    import pipeline.llm.engine as engine

    generator = Generator(tiny)
    tokenizer = generator.loaded.tokenizer
    question = encode(tokenizer, "Why is the sky blue?", ())
    for_one = len(question) + 4 + 1  # the prompt, up to 4 reply tokens, the separator
    monkeypatch.setattr(engine, "REMEMBERED_TOKENS", 3 * for_one)
    for session in "abcde":
        list(generator.steps(GenerationRequest(question, 4, drafter="suffix", session_key=session)))
    held = {key: len(memory.memory.text) for key, memory in generator._memories.items()}
    assert list(held) == ["c", "d", "e"] and all(0 < n <= for_one for n in held.values())
    list(generator.steps(GenerationRequest(question, 4, drafter="suffix", session_key="c")))  # c is kept and grows
    assert list(generator._memories) == ["e", "c"] and len(generator._memories["c"].memory.text) > held["c"]
    assert sum(len(m.memory.text) for m in generator._memories.values()) <= 3 * for_one
