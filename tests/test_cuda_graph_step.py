"""The one-token step replayed as CUDA graphs (pipeline/llm/cuda_graph_step.py) against the same
pass launched operation by operation, on the bundled target in float32.

The graphs need a CUDA device: bench/gpu_check.sh runs these tests with SPECVOX_LLM__DEVICE=cuda.
Elsewhere two of them run: no graph is made off a GPU, and the recorded step's body, run
eagerly, computes the eager step; the others skip.
"""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.llm.lean_llama import LeanLlama
from pipeline.llm.model import LlmOptions, load_model

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


def test_graph_body_computes_the_eager_step(lean: LeanLlama) -> None:
    """What a graph records, run eagerly on any device: the fixed-shape step (position as a tensor,
    attention over the whole capacity, masked) gives the eager step's logits and cache slot."""
    prompt = prompt_ids(lean, 30)
    eager = lean.eager()
    out = eager(torch.tensor([prompt], device=DEVICE), logits_to_keep=1)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    cache.reserve(cache.length + 200)  # spare slots past the position: the mask must hide them
    cache.keys[:, :, :, cache.length + 1 :] = 1e4  # and whatever they hold must not leak into attention
    position = cache.length
    lean._grow_rotary_table(cache.capacity)  # as the graphed pass does before it records
    logits, hidden = lean._graph_body(token, torch.tensor([position], device=DEVICE), cache.keys, cache.values,
                                      lean._cos, lean._sin)
    graph_keys = cache.keys[:, :, :, position].clone()
    reference = eager(token, cache=cache, logits_to_keep=1)
    assert torch.allclose(logits, reference.logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(hidden, reference.hidden, atol=1e-4, rtol=1e-4)
    assert torch.allclose(graph_keys, cache.keys[:, :, :, position], atol=1e-5)


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
    assert graphed.tokens == eager.tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(graphed.logits, eager.logits, strict=True))
    assert worst < 1e-3, f"graphed logits drift {worst:.2e} from the eager pass's"


@on_cuda
def test_interleaved_replies_each_replay_their_own_graph(lean: LeanLlama) -> None:
    """Two replies stepped in turn (two caches, two graphs) each equal their reply decoded alone,
    and each cache is recorded once, not once a step."""
    first, second = prompt_ids(lean, 11), prompt_ids(lean, 23)
    before = lean.graphed.recordings
    together = [Reply(lean, first), Reply(lean, second)]
    for _ in range(30):
        for reply in together:
            reply.step()
    assert lean.graphed.recordings - before == 2
    for prompt, reply in zip((first, second), together, strict=True):
        alone = Reply(lean.eager(), prompt)
        for _ in range(30):
            alone.step()
        assert reply.tokens == alone.tokens


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
