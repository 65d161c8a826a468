"""Token trees: several draft continuations verified in one target pass.

A drafter that sees more than one plausible continuation (an n-gram that occurred several times,
a head's top-k) merges them into a trie: common prefixes once, a node per distinct token after
them. One pass of the target over [last context token, every node] with a tree attention mask
(each node sees the context and its own ancestors: SpecInfer, Miao et al. 2024, §4.2, "tree-based
parallel decoding") gives the target's next-token distribution after every path at once.

Acceptance walks the tree from the root: at each node the target chooses its own next token (the
argmax, or a draw from its distribution at that reply position) and the walk moves to the child
holding that token, if any. The output is therefore always the target's own choice, token by
token, whatever the tree: lossless for greedy and for sampling alike. For drafts that are a
deterministic function of the context (the n-gram branches, a head's top-k) this is the
multi-draft rule of SpecInfer (Algorithm 2) with point-mass drafts: a child c is taken with
probability p(c), a rejected one removed from p before the next, which is the same as one draw
from p. Drafts sampled from a distribution q would need SpecInfer's residual rule; none are
made here.

The pass computes each row alone (pipeline/llm/kernels/lean_step.cpp attends, slot by slot in the
cache's order, to exactly the slots a row may see), so a node's logits are bit for bit what plain
decoding of its path computes, and after the walk the cache keeps the accepted path's keys and
values moved into consecutive slots (`KVCache.keep_slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens as a trie, nodes in breadth-first order (each parent before its children).

    Node i holds `tokens[i]`; `parents[i]` is its parent node, or -1 for a child of the root (the
    context's last token, which the pass computes as row 0; node i is row i + 1).
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], max_nodes: int) -> TokenTree:
        """The trie of `paths`, earlier paths first, cut breadth-first at `max_nodes` nodes (the
        shallow nodes, which every deeper one needs, are kept)."""
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node, in creation order
        node_parent: list[int] = []
        node_token: list[int] = []
        node_depth: list[int] = []
        for path in paths:
            parent = -1
            for depth, token in enumerate(path):
                node = children.get((parent, token))
                if node is None:
                    node = children[(parent, token)] = len(node_token)
                    node_parent.append(parent)
                    node_token.append(int(token))
                    node_depth.append(depth)
                parent = node
        order = sorted(range(len(node_token)), key=lambda n: (node_depth[n], n))[:max_nodes]
        kept = set(order)
        order = [n for n in order if node_parent[n] == -1 or node_parent[n] in kept]  # never an orphan
        index = {n: i for i, n in enumerate(order)}
        return cls(tuple(node_token[n] for n in order),
                   tuple(-1 if node_parent[n] == -1 else index[node_parent[n]] for n in order))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        """One path: what a plain draft is."""
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the root."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def positions(self, past: int) -> list[int]:
        """The positions of the pass's rows: the root at `past` (the cache holds the context before
        it), each node one past its parent."""
        return [past, *(past + d for d in self.depths())]

    def visible(self, past: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [1 + n, past + 1 + n]: which slots each row attends to (the rows are written at
        slots past..). Every row sees the cache and the root; a node also its ancestors and itself."""
        n = len(self)
        mask = torch.zeros(1 + n, past + 1 + n, dtype=torch.bool)
        mask[:, : past + 1] = True
        for i, parent in enumerate(self.parents):
            row = i + 1
            mask[row, past + row] = True
            if parent >= 0:
                mask[row, past + 1 : past + 1 + n] |= mask[parent + 1, past + 1 : past + 1 + n]
        return mask.to(device)

    def walk(self, target_token: Callable[[int, list[int]], int]) -> tuple[list[int], int]:
        """(the accepted nodes, root to leaf; the token the target chose after the last of them).

        `target_token(row, path)`: the target's token after `row` (0: the root; node i: i + 1),
        whose accepted nodes so far are `path`: the argmax, or a draw at that reply position.
        """
        path: list[int] = []
        row = 0
        while True:
            token = target_token(row, path)
            parent = row - 1
            child = next((i for i, p in enumerate(self.parents) if p == parent and self.tokens[i] == token), None)
            if child is None:
                return path, token
            path.append(child)
            row = child + 1
