"""Token trees (pipeline/llm/token_tree.py): the trie of draft paths, its attention mask, the walk
that keeps the target's own choices, and one target pass over a tree computing, for every node,
what plain decoding of its path computes."""

from __future__ import annotations

import pytest
import torch

from pipeline.llm import engine
from pipeline.llm.draft_length import BranchWorth, VerifyCost
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.exact_codes import unavailable_reason
from pipeline.llm.kv_cache import KVCache
from pipeline.llm.model import load_model, rollback
from pipeline.llm.options import LlmOptions, SamplingOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from pipeline.llm.token_tree import TokenTree

needs_kernel = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

PATHS = [[11, 12, 13, 14], [11, 12, 20], [30, 31], [11, 40]]


def test_paths_merge_into_a_trie_in_breadth_first_order():
    tree = TokenTree.from_paths(PATHS, max_nodes=16)
    # by depth, then in the order the paths made them: 11, 30 | 12 (of 11), 31 (of 30), 40 (of 11) | 13, 20 | 14
    assert tree.tokens == (11, 30, 12, 31, 40, 13, 20, 14)
    assert tree.parents == (-1, -1, 0, 1, 0, 2, 2, 5)
    assert tree.depths() == [1, 1, 2, 2, 2, 3, 3, 4]
    assert TokenTree.chain([7, 8, 9]) == TokenTree.from_paths([[7, 8, 9]], max_nodes=8)


def test_a_node_budget_keeps_the_shallow_nodes_and_never_an_orphan():
    tree = TokenTree.from_paths(PATHS, max_nodes=4)
    assert tree.tokens == (11, 30, 12, 31)
    assert all(p < i for i, p in enumerate(tree.parents))
    assert TokenTree.from_paths([], max_nodes=4).tokens == ()


def test_each_row_sees_the_context_its_ancestors_and_itself():
    tree = TokenTree.from_paths([[1, 2], [1, 3], [4]], max_nodes=8)  # nodes: 1, 4, 2 (of 1), 3 (of 1)
    past = 3
    assert tree.positions(past) == [3, 4, 4, 5, 5]
    seen = tree.visible(past)
    assert seen.shape == (5, past + 5)
    expected = [
        [1, 1, 1, 1, 0, 0, 0, 0],  # the root: the cache and itself
        [1, 1, 1, 1, 1, 0, 0, 0],  # 1
        [1, 1, 1, 1, 0, 1, 0, 0],  # 4
        [1, 1, 1, 1, 1, 0, 1, 0],  # 2, after 1
        [1, 1, 1, 1, 1, 0, 0, 1],  # 3, after 1
    ]
    assert seen.int().tolist() == expected


def test_the_walk_follows_the_targets_own_tokens():
    tree = TokenTree.from_paths(PATHS, max_nodes=16)
    choices = {0: 11, 1: 40, 5: 99}  # after the root 11, after node 0 (11) 40, after node 4 (40) 99
    seen_paths = []

    def target(row: int, path: list[int]) -> int:
        seen_paths.append(list(path))
        return choices[row]

    assert tree.walk(target) == ([0, 4], 99)
    assert seen_paths == [[], [0], [0, 4]]
    assert tree.walk(lambda row, path: 5) == ([], 5)  # no child holds the target's token: nothing accepted


def _decode_path(lean, cache: KVCache, first: int, path_tokens: list[int]) -> torch.Tensor:
    """Logits [1 + len(path), V] of one-token passes over [first, *path], the cache rolled back after."""
    held = cache.get_seq_length()
    rows = [lean(input_ids=torch.tensor([[t]]), cache=cache, logits_to_keep=1).logits[0, 0]
            for t in [first, *path_tokens]]
    rollback(cache, held)
    return torch.stack(rows)


def _check_tree_pass(loaded, exact: bool) -> None:
    lean = loaded.lean
    prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, "Why do cats purr?"))
    tree = TokenTree.from_paths([[253, 1127, 30, 2365], [253, 1127, 288], [260, 3267], [253, 28]], max_nodes=16)
    with torch.inference_mode():
        cache = lean(input_ids=torch.tensor([prompt[:-1]]), logits_to_keep=1).cache
        past = cache.get_seq_length()
        out = lean(input_ids=torch.tensor([[prompt[-1], *tree.tokens]]), cache=cache,
                   position_ids=torch.tensor([tree.positions(past)]), visible=tree.visible(past)[None],
                   logits_to_keep=1 + len(tree))
        logits = out.logits[0]
        slots = slice(past, past + 1 + len(tree))
        tree_keys, tree_values = cache.keys[:, :, :, slots].clone(), cache.values[:, :, :, slots].clone()
        rollback(cache, past)
        leaves = [i for i in range(len(tree)) if i not in tree.parents]
        for leaf in leaves:
            path, node = [], leaf
            while node >= 0:
                path.insert(0, node)
                node = tree.parents[node]
            alone = _decode_path(lean, cache, prompt[-1], [tree.tokens[n] for n in path])
            together = logits[[0, *(n + 1 for n in path)]]
            if exact:
                assert torch.equal(together, alone), leaf
            else:
                torch.testing.assert_close(together, alone, rtol=0, atol=1e-10)
        # keep one path: the cache then holds what plain decoding of it wrote, and decoding goes on alike
        path, after = tree.walk(lambda row, path: [253, 1127, 288, 77][len(path)])
        assert [tree.tokens[n] for n in path] == [253, 1127, 288] and after == 77
        cache.length = past + 1 + len(tree)
        cache.keys[:, :, :, slots], cache.values[:, :, :, slots] = tree_keys, tree_values  # as the tree pass left them
        cache.keep_slots(past + 1, [past + 1 + n for n in path])
        assert cache.get_seq_length() == past + 4
        after_tree = lean(input_ids=torch.tensor([[77]]), cache=cache, logits_to_keep=1).logits[0, 0]
        rollback(cache, past)
        for token in [prompt[-1], 253, 1127, 288]:
            lean(input_ids=torch.tensor([[token]]), cache=cache, logits_to_keep=1)
        after_plain = lean(input_ids=torch.tensor([[77]]), cache=cache, logits_to_keep=1).logits[0, 0]
    if exact:
        assert torch.equal(after_tree, after_plain)
    else:
        torch.testing.assert_close(after_tree, after_plain, rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def exact():
    return load_model(LlmOptions(dtype="float32", weights="int4-exact"))


@needs_kernel
def test_one_fused_pass_over_a_tree_computes_every_path_as_plain_decoding_does(exact):
    """The bundled target on its own codes (the C++ pass): bit for bit, every node and the cache kept."""
    assert exact.lean is not None and exact.lean.step is not None
    _check_tree_pass(exact, exact=True)


def test_one_pass_of_torch_operations_over_a_tree_computes_every_path_as_plain_decoding_does(tiny_llm_dir):
    loaded = load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float64"))
    assert loaded.lean is not None and loaded.lean.step is None
    _check_tree_pass(loaded, exact=False)


SAMPLINGS = (SamplingOptions(), SamplingOptions(temperature=0.8, top_p=0.95, seed=11))


def _replies(generator: Generator, drafter: str, branches: int, sampling: SamplingOptions, count: int = 2,
             max_new: int = 32) -> list[tuple[int, ...]]:
    prompts = load_prompts()
    tokenizer = generator.loaded.tokenizer
    out = []
    for task, texts in ((Task.CAPTION, prompts["caption"]), (Task.DIALOGUE, prompts["dialogue"])):
        for text in texts[:count]:
            ids = tuple(encode_chat(tokenizer, chat_messages(task, text)))
            request = GenerationRequest(ids, max_new, drafter, sampling, draft_branches=branches)
            out.append(tuple(t for step in generator.steps(request) for t in step.token_ids))
    return out


@pytest.fixture(scope="module")
def plain_replies(exact) -> list[list[tuple[int, ...]]]:
    """Plain decoding's replies under each of SAMPLINGS, which the tree drafters must give."""
    generator = Generator(exact)
    return [_replies(generator, "none", 0, sampling) for sampling in SAMPLINGS]


@needs_kernel
@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_replies_drafted_as_trees_are_plain_decodings_replies(exact, plain_replies, drafter, monkeypatch):
    """Greedy and seeded sampling: token for token what plain decoding says, trees verified on the way,
    some of their tokens accepted from a branch other than the draft. A verified row is made free,
    so that no branch is judged not worth its row (`BranchWorth`)."""
    walks: list[tuple[int, int]] = []  # (nodes, the first accepted node)
    verify_tree = engine.RequestDecoder._verify_tree

    def counted(self, tree, *args, **kwargs):
        accepted = verify_tree(self, tree, *args, **kwargs)
        walks.append((len(tree), self.kept[0] if self.kept else -1))
        return accepted

    monkeypatch.setattr(engine.RequestDecoder, "_verify_tree", counted)
    generator = Generator(exact)
    generator.verify_cost = VerifyCost(prior=0.0, frozen=True)
    for sampling, plain in zip(SAMPLINGS, plain_replies, strict=True):
        assert _replies(generator, drafter, 3, sampling) == plain
    assert walks, "no tree was verified"
    first_tokens = {first for _, first in walks}
    assert any(first > 0 for first in first_tokens), "no token accepted from a branch"


def test_a_branch_that_wins_less_than_its_rows_cost_leaves_the_tree_and_is_probed():
    worth = BranchWorth(probe_every=16)
    chain, winner, loser = (1, 2, 3), (1, 7, 8), (4, 5, 6)
    for _ in range(40):  # the target always goes the winner's way for two tokens past the chain's one
        worth.observe(chain, (loser, winner), (1, 7, 8))
    assert worth.gain(0) < 0.05 and worth.gain(1) > 1.9
    kept = [worth.keep(chain, (loser, winner), verify_cost_per_token=0.3) for _ in range(32)]
    assert kept.count((winner,)) == 30 and kept.count((loser, winner)) == 2  # the loser: a probe in 16
    assert worth.keep(chain, (loser, winner), verify_cost_per_token=0.0) == (loser, winner)  # free rows: all
    fresh = BranchWorth()
    assert fresh.keep(chain, (loser,), 0.1) == (loser,)  # untried: the prior's half token pays 3 rows at 0.1


@needs_kernel
def test_tree_branches_that_do_not_pay_are_dropped_and_replies_stay_plain_decodings(exact, plain_replies,
                                                                                   monkeypatch):
    """Rows as dear as this CPU's worst (b = 1: a verified row costs a plain step): no branch's
    prior pays its rows, so trees are verified only as the probes, and greedy replies are plain
    decoding's all the same."""
    trees = []
    verify_tree = engine.RequestDecoder._verify_tree
    monkeypatch.setattr(engine.RequestDecoder, "_verify_tree",
                        lambda self, tree, *a, **k: trees.append(len(tree)) or verify_tree(self, tree, *a, **k))
    generator = Generator(exact)
    generator.verify_cost = VerifyCost(prior=1.0, frozen=True)
    assert _replies(generator, "ngram", 3, SamplingOptions()) == plain_replies[0]
    worth = generator._branch_worth["ngram-tree"]
    assert worth._steps > 0  # branches were found
    assert len(trees) == worth._steps // worth.probe_every  # only the probes verified them


def test_trees_through_torchs_operations_decode_as_plain_decoding(tiny_llm_dir):
    loaded = load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float64"))
    generator = Generator(loaded)
    prompt = (5, 9, 12, 7, 3, 5, 9, 40, 5, 9, 12, 8)
    for sampling in (SamplingOptions(), SamplingOptions(temperature=1.0, seed=3)):
        plain = [t for s in generator.steps(GenerationRequest(prompt, 30, "none", sampling)) for t in s.token_ids]
        tree = [t for s in generator.steps(GenerationRequest(prompt, 30, "ngram", sampling, draft_branches=3))
                for t in s.token_ids]
        assert tree == plain


@needs_kernel
def test_rows_of_a_batch_drafted_as_trees_are_plain_decodings_replies(exact, monkeypatch):
    """Four replies in one batch, ngram trees beside plain drafts and padding: each row's tokens are
    its plain decoding's, greedy and seeded, and the kept paths' slots serve the later passes."""
    from pipeline.llm.batch import BatchedDecoder

    trees = []
    verify_tree = engine.RequestDecoder._verify_tree
    monkeypatch.setattr(engine.RequestDecoder, "_verify_tree",
                        lambda self, tree, *a, **k: trees.append(len(tree)) or verify_tree(self, tree, *a, **k))
    generator = Generator(exact)
    prompts = load_prompts()
    encoded = [tuple(encode_chat(exact.tokenizer, chat_messages(task, text)))
               for task, text in ((Task.CAPTION, prompts["caption"][0]), (Task.CAPTION, prompts["caption"][1]),
                                  (Task.DIALOGUE, prompts["dialogue"][0]), (Task.DIALOGUE, prompts["dialogue"][1]))]
    for sampling in (SamplingOptions(), SamplingOptions(temperature=0.8, seed=5)):
        plain = [tuple(t for s in generator.steps(GenerationRequest(ids, 32, "none", sampling)) for t in s.token_ids)
                 for ids in encoded]
        decoder = BatchedDecoder(generator, 4, max_verify_tokens=None)
        rows = {id(decoder.add(GenerationRequest(ids, 32, drafter, sampling, draft_branches=3))): i
                for i, (ids, drafter) in enumerate(zip(encoded, ["ngram", "suffix", "ngram", "none"], strict=True))}
        got: list[list[int]] = [[] for _ in encoded]
        while decoder.active:
            for row, step in decoder.step():
                got[rows[id(row)]].extend(step.token_ids)
        assert [tuple(g) for g in got] == plain
    assert trees, "no tree was verified in the batch"
