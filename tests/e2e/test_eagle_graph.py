"""EAGLE's greedy draft chain as one CUDA graph (pipeline/llm/eagle_graph.py) against eager drafting, with
the head shipped for the bundled target in float32.

Off a GPU no chain is graphed; there the recorded body (`chain_body`) runs eagerly, and a `DraftChain`
whose graphs are captured by a CPU stand-in (tests/graph_stand_in.py: a replay reruns the body on the
static inputs) drafts what eager drafting drafts, reply after reply, through the real keys, buffers and
inputs. bench/gpu_check.sh runs these tests with SPECVOX_LLM__DEVICE=cuda, where the graphs are real.
"""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.llm.draft_head import TrainedHead
from pipeline.llm.draft_length import VerifyCost
from pipeline.llm.eagle_graph import HEAD_GRAPH_BUFFERS, DraftChain, chain_body
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions, SamplingOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from tests.graph_stand_in import stand_in

DEVICE = os.environ.get("SPECVOX_LLM__DEVICE", "cpu")
CUDA = DEVICE.startswith("cuda") and torch.cuda.is_available()
PROMPTS = load_prompts()
TEXTS = [PROMPTS["dialogue"][0], PROMPTS["caption"][0]]
FIXED = {"max_draft_tokens": 5, "adaptive_draft": False}  # drafts of 5 every step


@pytest.fixture(scope="module")
def generator() -> Generator:
    options = LlmOptions(dtype="float32", device=DEVICE, weights="dense")
    generator = Generator.from_options(load_model(options), options)
    assert "eagle" in generator.draft_heads, "no shipped EAGLE head for the bundled target"
    return generator


@pytest.fixture
def trained(generator: Generator):
    """The shipped head; its graphed chain (a CPU stand-in's off a GPU) is put back afterwards."""
    head = generator.draft_heads["eagle"]
    kept = head.chain
    yield head
    head.chain = kept


def prompt(generator: Generator, text: str) -> tuple[int, ...]:
    return tuple(encode_chat(generator.loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))


def cpu_chain(trained: TrainedHead, capacity: int = 1024) -> DraftChain:
    """The head's chain with its graphs captured by the CPU stand-in."""
    chain = DraftChain(trained.head, trained.embed, trained.readout, trained.vocab, capacity)
    stand_in(chain.graphs)
    return chain


def drafts(generator: Generator, trained: TrainedHead, chain: DraftChain | None, text: str, branches: int = 0,
           proposals: int = 6) -> list:
    """The drafts a head drafter proposes along the plain greedy reply to `text`, `chain` graphing them or not."""
    trained.chain = chain
    ids = prompt(generator, text)
    plain = [t for s in generator.steps(GenerationRequest(ids, 3 * proposals, "none")) for t in s.token_ids]
    drafter = trained.drafter(SamplingOptions())
    drafter.branches = branches
    context = list(ids)
    out = generator.forward(input_ids=torch.tensor([context[:-1]], device=generator.loaded.device), logits_to_keep=0)
    drafter.observe(0, out.hidden[0])
    proposed = []
    for i in range(proposals):
        proposed.append(drafter.propose(context, 5))
        step = plain[3 * i : 3 * i + 3]  # the target commits three tokens; the head sees their features
        hidden = generator.forward(input_ids=torch.tensor([context + step[:-1]], device=generator.loaded.device),
                                   logits_to_keep=0).hidden[0]
        drafter.observe(len(context) - 1, hidden[len(context) - 1 :])
        context += step
    return proposed


def test_no_chain_is_graphed_off_a_gpu(generator: Generator) -> None:
    chain = generator.draft_heads["eagle"].chain
    assert (chain is not None) == CUDA


def test_the_recorded_body_drafts_what_the_head_drafts_eagerly(generator: Generator, trained: TrainedHead) -> None:
    """`chain_body`, run eagerly over a fixed-capacity cache, gives eager drafting's tokens and top-k."""
    ids = prompt(generator, TEXTS[0])
    hidden = generator.forward(input_ids=torch.tensor([ids[:-1]], device=generator.loaded.device),
                               logits_to_keep=0).hidden[0]
    trained.chain = None
    drafter = trained.drafter(SamplingOptions())
    drafter.branches = 3
    drafter.min_value = -1.0  # every sibling offered: the tree holds each step's whole top-k
    drafter.observe(0, hidden)
    eager = drafter.propose(list(ids), 6)
    # the same catch-up, then the body over a cache in a buffer of fixed capacity
    drafter.observe(0, hidden)
    cache = drafter._cache
    chain = cpu_chain(trained)
    assert chain.place(cache, len(ids) + 6)
    features = torch.stack(drafter.features)[None]
    g = drafter._block(trained.head, features, trained.embed[torch.tensor(ids[1:], device=features.device)][None],
                       0)[:, -1:]
    where = torch.tensor([len(ids) - 1, cache.length], device=features.device)
    tokens, top_p, top_tokens = chain_body(trained.head, trained.embed, trained.readout, trained.vocab, 6, 3, g,
                                           where, cache.keys, cache.values)
    assert tuple(tokens.tolist()) == eager.tokens
    offered = {path for path in eager.branches}
    from_body = {(*eager.tokens[:i], int(t)) for i in range(6) for t in top_tokens[i, 1:].tolist()}
    assert offered == from_body
    assert bool((top_p.sum(-1) <= 1 + 1e-6).all()) and bool((top_p[:, :-1] >= top_p[:, 1:]).all())  # best first


@pytest.mark.parametrize("branches", [0, 2])
def test_graphed_chains_draft_as_eager_ones(generator: Generator, trained: TrainedHead, branches: int) -> None:
    """Proposal after proposal along a reply (the cache rolled back and caught up between them), the
    graphed chain drafts the eager chain's tokens and siblings; one graph per draft length and buffer."""
    eager = drafts(generator, trained, None, TEXTS[1], branches)
    chain = cpu_chain(trained) if not CUDA else trained.chain
    graphed = drafts(generator, trained, chain, TEXTS[1], branches)
    assert graphed == eager
    assert 1 <= chain.graphs.recordings <= HEAD_GRAPH_BUFFERS


@pytest.mark.parametrize("text", TEXTS)
def test_greedy_with_the_graphed_chain_is_plain_decoding(generator: Generator, trained: TrainedHead,
                                                         text: str, monkeypatch) -> None:
    """Replies drafted by graphed chains (and trees) are plain decoding's, and a second reply replays
    the graphs the first recorded: its cache took the buffer the first one's left."""
    monkeypatch.setattr(generator, "verify_cost", VerifyCost(prior=0.0, frozen=True))  # trees as wide as allowed
    ids = prompt(generator, text)
    plain = [t for s in generator.steps(GenerationRequest(ids, 40, "none")) for t in s.token_ids]
    trained.chain = chain = cpu_chain(trained) if not CUDA else trained.chain
    for branches in (0, 2):
        request = GenerationRequest(ids, 40, "eagle", draft_branches=branches, **FIXED)
        assert [t for s in generator.steps(request) for t in s.token_ids] == plain
        assert generator.last_stats.accepted_draft_tokens > 0
        recorded = chain.graphs.recordings
        assert [t for s in generator.steps(request) for t in s.token_ids] == plain
        assert chain.graphs.recordings == recorded, "the second reply replays the first one's graphs"


def test_a_chain_without_a_free_buffer_drafts_eagerly(generator: Generator, trained: TrainedHead) -> None:
    """A reply longer than the buffers, or one beside every buffer taken, drafts eagerly, and the same."""
    eager = drafts(generator, trained, None, TEXTS[0], proposals=2)
    short = cpu_chain(trained, capacity=16)  # shorter than the prompt: never placed
    assert drafts(generator, trained, short, TEXTS[0], proposals=2) == eager
    assert short.graphs.recordings == 0


def test_sampled_drafts_stay_eager(generator: Generator, trained: TrainedHead) -> None:
    """Sampling draws each draft token from its position's generator on the host: no graph."""
    trained.chain = chain = cpu_chain(trained) if not CUDA else trained.chain
    before = chain.graphs.recordings
    sampling = SamplingOptions(temperature=0.8, seed=7)
    request = GenerationRequest(prompt(generator, TEXTS[0]), 24, "eagle", sampling=sampling, **FIXED)
    list(generator.steps(request))
    assert chain.graphs.recordings == before
