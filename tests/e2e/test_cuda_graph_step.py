"""Decoding and verification passes replayed as CUDA graphs (pipeline/llm/cuda_graph_step.py) against the same
pass launched operation by operation, on the bundled target in float32.

The graphs need a CUDA device: bench/gpu_check.sh runs these tests with SPECVOX_LLM__DEVICE=cuda.
Elsewhere the tests that need no graph run: no graph is made off a GPU; the recorded pass's body,
run eagerly, computes the eager step, verification and tree verification; the buffers graphs are
recorded over go from reply to reply. The others skip.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from pipeline.llm.cuda_graph_step import GraphBuffers, GraphedPass, Stopwatch
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.kv_cache import KVCache
from pipeline.llm.lean_llama import LeanLlama
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions
from pipeline.llm.prefix_cache import PrefixCache
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from pipeline.llm.token_tree import TokenTree
from tests.graph_stand_in import stand_in

DEVICE = os.environ.get("SPECVOX_LLM__DEVICE", "cpu")
on_cuda = pytest.mark.skipif(not (DEVICE.startswith("cuda") and torch.cuda.is_available()),
                             reason="CUDA graphs need a CUDA device (SPECVOX_LLM__DEVICE=cuda)")


@pytest.fixture(scope="module")
def lean() -> LeanLlama:
    loaded = load_model(LlmOptions(dtype="float32", device=DEVICE, weights="dense"))
    assert loaded.lean is not None
    return loaded.lean


class Reply:
    """A greedy reply decoded step by step, keeping each step's logits."""

    def __init__(self, lean: LeanLlama, prompt: list[int]) -> None:
        out = lean(torch.tensor([prompt], device=DEVICE), logits_to_keep=1)
        self.lean, self.cache = lean, out.cache
        self.logits = [out.logits[0, -1]]
        self.tokens = [int(self.logits[-1].argmax())]

    def step(self) -> None:
        out = self.lean(torch.tensor([[self.tokens[-1]]], device=DEVICE), cache=self.cache, logits_to_keep=1)
        self.cache = out.cache
        self.logits.append(out.logits[0, -1])
        self.tokens.append(int(self.logits[-1].argmax()))


def prompt_ids(lean: LeanLlama, words: int) -> list[int]:
    """A prompt of about `words` tokens; lengths near a cache chunk's end make the buffer grow mid-reply."""
    generator = torch.Generator().manual_seed(words)
    return torch.randint(100, lean.embed.shape[0] - 100, (words,), generator=generator).tolist()


def test_no_graphs_off_a_gpu(lean: LeanLlama) -> None:
    if DEVICE.startswith("cuda") and torch.cuda.is_available():
        assert lean.graphed is not None, "float32 on a CUDA device replays its one-token steps as graphs"
    else:
        assert lean.graphed is None


def graph_body(lean: LeanLlama, ids: torch.Tensor, cache: KVCache, positions: list[int] | None = None,
               ancestors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`LeanLlama._graph_body` run eagerly on `cache` (its length moved past the pass, as
    `_graphed_pass` does), for a chain or, with `positions` and `ancestors`, a tree."""
    n = ids.shape[1]
    start = cache.extend(n)
    slots = list(range(start, start + n))
    where = torch.tensor([positions or slots, slots], device=DEVICE)
    if ancestors is None:
        ancestors = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()
    lean._grow_rotary_table(cache.capacity)  # as the graphed pass does before it records
    return lean._graph_body(ids, where, ancestors, cache.keys, cache.values, lean._cos, lean._sin)


def prefilled(lean: LeanLlama, prompt: list[int], spare: int = 200) -> KVCache:
    """The prompt's cache, with spare slots full of junk past it: the mask must hide them."""
    cache = lean(torch.tensor([prompt], device=DEVICE), logits_to_keep=1).cache
    cache.reserve(cache.length + spare)
    cache.keys[:, :, :, cache.length :] = 1e4
    cache.values[:, :, :, cache.length :] = -1e4
    return cache


@pytest.mark.parametrize("n", [1, 5])
def test_graph_body_computes_the_eager_pass(lean: LeanLlama, n: int) -> None:
    """What a graph records, run eagerly on any device: the fixed-shape pass (positions and slots
    as tensors, attention over the whole capacity, masked) gives the eager pass's logits, features
    and cache slots, for a one-token step and a five-token verification."""
    eager = lean.eager()
    prompt, tokens = prompt_ids(lean, 30), torch.tensor([prompt_ids(lean, n)], device=DEVICE)
    graph_cache, eager_cache = prefilled(eager, prompt), prefilled(eager, prompt)
    logits, hidden = graph_body(lean, tokens, graph_cache)
    reference = eager(tokens, cache=eager_cache)
    assert torch.allclose(logits, reference.logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(hidden, reference.hidden, atol=1e-4, rtol=1e-4)
    live = slice(0, eager_cache.length)
    assert torch.allclose(graph_cache.keys[:, :, :, live], eager_cache.keys[:, :, :, live], atol=1e-5)
    assert torch.allclose(graph_cache.values[:, :, :, live], eager_cache.values[:, :, :, live], atol=1e-5)


def test_graph_body_verifies_a_token_tree_as_the_eager_pass_does(lean: LeanLlama) -> None:
    """A tree's rows (positions by depth, each seeing its own path) through the recorded body equal
    the eager pass given the same positions and mask."""
    eager = lean.eager()
    prompt = prompt_ids(lean, 25)
    tree = TokenTree.from_paths([[11, 12, 13], [11, 14], [15]], max_nodes=8)
    ids = torch.tensor([[7, *tree.tokens]], device=DEVICE)
    graph_cache, eager_cache = prefilled(eager, prompt), prefilled(eager, prompt)
    past = eager_cache.length
    visible = tree.visible(past, DEVICE)
    logits, _ = graph_body(lean, ids, graph_cache, tree.positions(past), visible[:, past:])
    reference = eager(ids, cache=eager_cache, position_ids=torch.tensor([tree.positions(past)], device=DEVICE),
                      visible=visible[None])
    assert torch.allclose(logits, reference.logits, atol=1e-4, rtol=1e-4)


def small_cache(lean: LeanLlama, length: int = 10) -> KVCache:
    cache = KVCache(len(lean.layers), 1, lean.kv_heads, lean.head_dim, lean.embed.dtype, DEVICE, capacity=length)
    cache.extend(length)
    cache.keys[:, :, :, :length] = torch.randn_like(cache.keys[:, :, :, :length])
    return cache


def test_graph_buffers_hand_a_dropped_replys_buffer_to_the_next(lean: LeanLlama) -> None:
    """Replies take free buffers (their live slots moved along), a dropped reply's buffer goes to the
    next, a held view keeps it taken, a cache the prefix cache keeps moves out, and a reply past the
    capacity or past the count runs eagerly."""
    buffers = GraphBuffers(capacity=256, count=2)
    first, second = small_cache(lean), small_cache(lean)
    live = first.keys[:, :, :, :10].clone()
    assert buffers.place(first, 11) and buffers.place(first, 11) and len(buffers.buffers) == 1
    assert first.capacity == 256 and torch.equal(first.keys[:, :, :, :10], live)
    assert buffers.place(second, 11) and len(buffers.buffers) == 2
    assert not buffers.place(small_cache(lean), 11), "two buffers, both taken"
    assert not buffers.place(first, 257), "past the capacity"
    held = first.keys[:, :, :, :5]  # a slice kept after its cache is gone still reads the buffer
    taken_by_first = first.keys.data_ptr()
    del first
    third = small_cache(lean)
    assert not buffers.place(third, 11)
    del held
    assert buffers.place(third, 11) and third.keys.data_ptr() == taken_by_first
    kept = second.keys[:, :, :, :10].clone()
    PrefixCache(sessions=2).put("session", list(range(10)), second)  # kept for the session's next turn
    assert not buffers.holds(second) and not second.borrowed and torch.equal(second.keys[:, :, :, :10], kept)
    assert buffers.place(small_cache(lean), 11), "a kept cache leaves its buffer free"


@on_cuda
@pytest.mark.parametrize("length", [7, 120, 300])
def test_graphed_steps_decode_as_eager_steps(lean: LeanLlama, length: int) -> None:
    """Token for token the eager pass's greedy reply, logits within float32 rounding, at prompt
    lengths where the cache grows before the first graphed step (120) or not (7, 300)."""
    prompt = prompt_ids(lean, length)
    graphed, eager = Reply(lean, prompt), Reply(lean.eager(), prompt)
    for _ in range(40):
        graphed.step()
        eager.step()
    assert lean.graph_buffers.holds(graphed.cache), "the reply ran in a graphs' buffer, not eagerly"
    assert graphed.tokens == eager.tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(graphed.logits, eager.logits, strict=True))
    assert worst < 1e-3, f"graphed logits drift {worst:.2e} from the eager pass's"


@on_cuda
def test_interleaved_replies_each_replay_their_own_graph(lean: LeanLlama) -> None:
    """Two replies stepped in turn (two buffers, two graphs) each equal their reply decoded alone,
    and each buffer is recorded once, not once a step; a later reply takes a dropped reply's buffer
    and replays its graph, recording nothing."""
    first, second = prompt_ids(lean, 41), prompt_ids(lean, 53)  # prefilled eagerly: longer than any graphed pass
    before = lean.graphed.recordings
    together = [Reply(lean, first), Reply(lean, second)]
    for _ in range(30):
        for reply in together:
            reply.step()
    assert all(lean.graph_buffers.holds(reply.cache) for reply in together), "each reply in a buffer of its own"
    assert together[0].cache.keys.data_ptr() != together[1].cache.keys.data_ptr()
    assert lean.graphed.recordings - before <= 2
    for prompt, reply in zip((first, second), together, strict=True):
        alone = Reply(lean.eager(), prompt)
        for _ in range(30):
            alone.step()
        assert reply.tokens == alone.tokens
    del together, reply
    recorded = lean.graphed.recordings
    later = Reply(lean, prompt_ids(lean, 47))
    for _ in range(10):
        later.step()
    assert lean.graph_buffers.holds(later.cache), "a dropped reply's buffer is free again"
    assert lean.graphed.recordings == recorded, "a freed buffer's graph serves the next reply"


@on_cuda
@pytest.mark.parametrize("n", [2, 6])
def test_graphed_verification_equals_the_eager_pass(lean: LeanLlama, n: int) -> None:
    """A verification pass of n tokens replayed as a graph (recorded at the first, replayed at the
    second) gives the eager pass's logits and leaves the same keys in the cache."""
    for round_ in range(2):
        prompt, draft = prompt_ids(lean, 40 + round_), torch.tensor([prompt_ids(lean, n)], device=DEVICE)
        graphed, eager = Reply(lean, prompt), Reply(lean.eager(), prompt)
        out = lean(draft, cache=graphed.cache, logits_to_keep=n)
        reference = eager.lean(draft, cache=eager.cache, logits_to_keep=n)
        assert lean.graph_buffers.holds(graphed.cache)
        assert torch.allclose(out.logits, reference.logits, atol=1e-3, rtol=1e-3)
        assert torch.equal(out.logits.argmax(-1), reference.logits.argmax(-1))
        live = slice(0, eager.cache.length)
        assert graphed.cache.length == eager.cache.length
        assert torch.allclose(graphed.cache.keys[:, :, :, live], eager.cache.keys[:, :, :, live], atol=1e-4)


@on_cuda
def test_graphed_tree_verification_equals_the_eager_pass(lean: LeanLlama) -> None:
    """A token tree's verification replayed as a graph, twice with different trees of one size (the
    ancestors are an input, not a recorded constant), equals the eager tree pass."""
    for paths in ([[11, 12, 13], [11, 14], [15]], [[21], [22, 23], [22, 24, 25]]):
        tree = TokenTree.from_paths(paths, max_nodes=8)
        prompt = prompt_ids(lean, 33)
        graphed, eager = Reply(lean, prompt), Reply(lean.eager(), prompt)
        past = eager.cache.length
        ids = torch.tensor([[graphed.tokens[-1], *tree.tokens]], device=DEVICE)
        extra = {"position_ids": torch.tensor([tree.positions(past)], device=DEVICE),
                 "visible": tree.visible(past, DEVICE)[None]}
        out = lean(ids, cache=graphed.cache, logits_to_keep=ids.shape[1], **extra)
        reference = eager.lean(ids, cache=eager.cache, logits_to_keep=ids.shape[1], **extra)
        assert torch.allclose(out.logits, reference.logits, atol=1e-3, rtol=1e-3)


@on_cuda
def test_rollback_then_graphed_step_overwrites_the_dropped_slot(lean: LeanLlama) -> None:
    """A verification pass's rejected tail is dropped by moving the cache's length; the graphed step
    after it writes its key and value over the dropped slots, as the eager pass does."""
    prompt = prompt_ids(lean, 40)
    replies = [Reply(lean, prompt), Reply(lean.eager(), prompt)]
    for reply in replies:
        reply.step()
        junk = torch.tensor([[5, 6, 7]], device=DEVICE)
        reply.lean(junk, cache=reply.cache, logits_to_keep=1)  # a three-token draft, all rejected
        reply.cache.crop(-3)
        for _ in range(10):
            reply.step()
    assert replies[0].tokens == replies[1].tokens


def test_recording_ahead_records_each_chain_length_once(lean: LeanLlama) -> None:
    """`record_graphs` (the engine's warm-up) records chains of 1 to n tokens; a second call, and a
    reply's passes of those lengths after it, record nothing. Off a GPU it records nothing at all."""
    if lean.graphed is None:
        assert lean.record_graphs(9) == 0
        return
    lean.record_graphs(9)
    assert lean.record_graphs(9) == 0
    recorded = lean.graphed.recordings
    reply = Reply(lean, prompt_ids(lean, 40))
    for n in (1, 4, 9):
        lean(torch.tensor([prompt_ids(lean, n)], device=DEVICE), cache=reply.cache, logits_to_keep=n)
    assert lean.graphed.recordings == recorded


RECORDING_S = 0.25  # a stand-in recording's seconds: on an H200 a recording costs some twenty replays


def test_a_recording_is_not_taken_for_the_price_of_its_pass() -> None:
    """The engine times its passes with `Stopwatch`, which leaves out graph recordings: a reply whose
    passes record (slowly) is timed at what its passes cost, and its drafting is judged on that."""
    loaded = load_model(LlmOptions(dtype="float32", device="cpu", weights="dense"))
    lean = loaded.lean
    lean.graphed, lean.graph_buffers = stand_in(GraphedPass(lean._graph_body), RECORDING_S), GraphBuffers()
    generator = Generator(loaded)
    transcript = ("Rewrite this transcript as a clean caption, keeping the speaker's words: so um we we shipped "
                  "the new build on friday and the the crash reports dropped by half over the weekend")
    prompt = tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, transcript)))
    watch = Stopwatch()
    steps = list(generator.steps(GenerationRequest(prompt, 24, "ngram")))
    stats, wall = steps[-1].stats, watch.seconds
    recordings = lean.graphed.recordings
    assert recordings >= 3, "the reply's passes ran through the stand-in's graphs"
    slept = recordings * RECORDING_S
    assert wall < Stopwatch().started - watch.started - 0.9 * slept, "the stopwatch leaves the recordings out"
    assert stats.prefill_s + stats.target_s + stats.draft_s < wall
    assert stats.accepted_draft_tokens > 0, "drafting judged on its passes' cost, not the recordings'"


def test_a_deep_copy_of_a_cache_in_a_buffer_is_its_own(lean: LeanLlama) -> None:
    """The end-of-turn scorer deep-copies a cache: the copy holds the live slots in buffers of its
    own (not the buffer's whole capacity), and the buffer stays the original's."""
    buffers = GraphBuffers(capacity=1024, count=1)
    cache = small_cache(lean)
    assert buffers.place(cache, 11)
    twin = copy.deepcopy(cache)
    assert not twin.borrowed and twin.capacity < 1024 and twin.length == cache.length
    assert torch.equal(twin.keys[:, :, :, :10], cache.keys[:, :, :, :10])
    assert buffers.holds(cache) and not buffers.holds(twin)
