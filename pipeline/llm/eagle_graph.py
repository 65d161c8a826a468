"""EAGLE's greedy draft chain replayed as one CUDA graph, so drafting k tokens costs one launch.

Drafting a chain with the EAGLE head (pipeline/llm/draft_head.py) is k readouts and k - 1 passes of
its one decoder layer, each a few dozen small kernels, and each draft token's id went back to the
host (`int()`) before the next pass could start: on a GPU that is ~40 launches and a device-to-host
sync a token, launch overhead against a verification pass that is itself one graph replay
(pipeline/llm/cuda_graph_step.py). Here the whole chain, from the head's output g at the last true
position, is one graph: each step's greedy token stays on the device, its embedding is gathered
there, its keys and values go to their cache slot by `index_copy_` and its attention covers the
head cache's whole capacity masked to the slots up to its own (as `LeanLlama._graph_body` does for
the target). The host reads the tokens once, after the replay. With token trees (EAGLE-2's dynamic
tree, `HeadDrafter`) each step's top-k of the head's distribution is an output too, and the host
picks the siblings from them as it does after eager drafting.

A graph is recorded per draft length, number of siblings and head cache buffer; the buffers are
handed from reply to reply (`GraphBuffers`), so a new reply replays what earlier ones recorded.
Sampled drafts stay eager: each draft token is drawn from its position's own generator, on the host.
What is recorded is `chain_body`, which tests run eagerly on a CPU against eager drafting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812

from pipeline.llm.cuda_graph_step import GraphBuffers, GraphSet, buffers_key
from pipeline.llm.kv_cache import KVCache
from pipeline.llm.sampling import greedy_tokens

if TYPE_CHECKING:
    from pipeline.llm.draft_head import EagleHead

# head cache buffers of the graphs: draft chains at once with graphs (another one drafts eagerly)
HEAD_GRAPH_BUFFERS = 4


def head_graphs_apply(device: torch.device, enabled: bool) -> bool:
    """The chain is graphed on a CUDA device where `llm.cuda_graphs` is on. Unlike the target's
    passes it may be in any dtype: a draft's rounding changes what is proposed, never the output."""
    return enabled and device.type == "cuda" and torch.cuda.is_available()


class DraftChain:
    """One EAGLE head's greedy chains, drafted by replaying graphs of `chain_body`."""

    def __init__(self, head: EagleHead, embed: torch.Tensor, readout: torch.Tensor, vocab: torch.Tensor,
                 capacity: int) -> None:
        """`embed` [V, D]: the target's token embeddings; `readout` [V', D]: W' over the draft
        vocabulary `vocab` [V'] (token ids); `capacity`: the head cache buffers' slots."""
        self.head, self.embed, self.readout, self.vocab = head, embed, readout, vocab
        self.graphs = GraphSet(self._chain)
        self.buffers = GraphBuffers(capacity, HEAD_GRAPH_BUFFERS)

    def place(self, cache: KVCache, needed: int) -> bool:
        """Whether the head cache `cache` is in a graph buffer with room for `needed` slots (moved
        there if it was not); false: this chain drafts eagerly."""
        return self.buffers.place(cache, needed)

    def draft(self, g: torch.Tensor, position: int, cache: KVCache, k: int, branches: int
              ) -> tuple[list[int], list[list[float]], list[list[int]]]:
        """`chain_body`'s tokens and each step's top 1 + `branches` probabilities and token ids, as
        lists, from the head's output g [1, 1, D] at the last true position, whose successor the first
        draft token is; the draft's keys and values go after the cache's live slots (which the
        caller does not advance: they are dropped). `cache` is in a graph buffer (`place`)."""
        key = (k, branches, *buffers_key((cache.keys, cache.values)))
        where = torch.tensor([position, cache.length], dtype=torch.int64)
        tokens, values, indices = self.graphs.run(key, (g, where), (cache.keys, cache.values),
                                                  lambda out: tuple(t.cpu() for t in out), constants=(k, branches))
        return tokens.tolist(), values.tolist(), indices.tolist()

    def _chain(self, k: int, branches: int, g: torch.Tensor, where: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return chain_body(self.head, self.embed, self.readout, self.vocab, k, branches, g, where, keys, values)


def chain_body(head: EagleHead, embed: torch.Tensor, readout: torch.Tensor, vocab: torch.Tensor, k: int,
               branches: int, g: torch.Tensor, where: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k greedy draft tokens [k] from the head's output g [1, 1, D], with shapes that do not depend
    on the values of `where` [2] (the position the second draft token's pass stands at, and its
    cache slot) or of the cache `keys`, `values` [1, 1, KV, capacity, hd]; and, for each step, the
    top 1 + `branches` probabilities of the head's distribution and their token ids ([k, 1 + branches]
    each; [k, 0] without branches). Step i > 0 writes the keys and values of the token before it at
    slot where[1] + i - 1 and attends to every slot up to that one."""
    slots = torch.arange(keys.shape[3], device=g.device)
    tokens: list[torch.Tensor] = []
    top_values: list[torch.Tensor] = []
    top_tokens: list[torch.Tensor] = []
    for i in range(k):
        if i:
            slot = where[1:] + (i - 1)
            cos, sin = head.rotary(where[:1] + (i - 1), g.dtype)
            seen = (slots <= slot)[None, None, None]  # [1, 1, 1, capacity]: the cache up to this token's slot

            def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slot: torch.Tensor = slot,
                       seen: torch.Tensor = seen) -> torch.Tensor:
                keys[0].index_copy_(2, slot, k_new)
                values[0].index_copy_(2, slot, v_new)
                return F.scaled_dot_product_attention(q, keys[0], values[0], attn_mask=seen,
                                                      enable_gqa=head.shape.heads != head.shape.kv_heads)

            g = head.layer(g, embed[tokens[-1]][None, None], cos, sin, attend)
        logits = g[0, 0] @ readout.T
        tokens.append(vocab[greedy_tokens(logits)])
        if branches:
            top = torch.topk(torch.softmax(logits.float(), dim=-1), 1 + branches)
            top_values.append(top.values)
            top_tokens.append(vocab[top.indices])
    if not branches:
        return torch.stack(tokens), g.new_zeros(k, 0, dtype=torch.float32), vocab.new_zeros(k, 0)
    return torch.stack(tokens), torch.stack(top_values), torch.stack(top_tokens)
