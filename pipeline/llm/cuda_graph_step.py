"""One-token decoding steps replayed as CUDA graphs, where a GPU step is launch overhead.

On an H200 a plain step of the bundled 135M target took ~14 ms (docs/benchmarks.md, "GPU
check"): a pass of 0.3 GFLOP spread over some 400 kernels, each launched from Python. A CUDA
graph records those launches once and replays them with one call (gpt-fast reaches the same
end with `torch.compile(mode="reduce-overhead")`). A graph fixes its tensors' shapes and
addresses, so the step it records (`LeanLlama._graph_body`) takes its position from a device
tensor, writes the new key and value at that slot (`index_copy_`) and attends over the cache's
whole capacity, masked to the slots up to the position.

A graph is recorded for each set of buffers it reads (a reply's KV cache, the rotary tables):
`LeanLlama` grows a cache `GRAPH_HEADROOM` slots ahead of need, so a long reply is recorded
again every few hundred tokens, not every `kv_cache.CHUNK_TOKENS`. The graphs of the last
`MAX_GRAPHS` caches are kept (each holds its buffers alive: a graph must never write into
memory that was freed and handed out again).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

GRAPH_HEADROOM = 512  # slots a cache grows by ahead of a graphed step, so it is recorded again rarely
MAX_GRAPHS = 4  # caches whose graphs are kept (concurrent replies, a session's cache kept between turns)
WARMUP_PASSES = 2  # eager passes on a side stream before recording (cuBLAS and the allocator settle)

# body(ids [1, 1], position [1] int64, *buffers) -> (logits [1, 1, V], hidden [1, 1, hidden_size])
StepBody = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Recorded:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # the graph's input token [1, 1]
    position: torch.Tensor  # the graph's slot [1]
    logits: torch.Tensor  # its outputs, overwritten by each replay
    hidden: torch.Tensor
    buffers: tuple[torch.Tensor, ...]  # kept alive while the graph may write into them


class GraphedStep:
    """`body` recorded once per set of buffers and replayed: `step(ids, position, *buffers)`
    computes what `body` computes, as one launch."""

    def __init__(self, body: StepBody, max_graphs: int = MAX_GRAPHS) -> None:
        self.body, self.max_graphs = body, max_graphs
        self.graphs: OrderedDict[tuple, _Recorded] = OrderedDict()
        self.recordings = 0  # graphs recorded so far (tests and benchmarks read it)
        self._lock = threading.Lock()  # a replay and the copies of its outputs happen together

    def __call__(self, ids: torch.Tensor, position: int, *buffers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and hidden state of token `ids` [1, 1] at slot `position`; fresh tensors."""
        key = tuple((b.data_ptr(), tuple(b.shape), b.dtype) for b in buffers)
        with self._lock:
            recorded = self.graphs.get(key)
            if recorded is None:
                recorded = self._record(ids, position, buffers)
                self.graphs[key] = recorded
                while len(self.graphs) > self.max_graphs:
                    self.graphs.popitem(last=False)
            else:
                self.graphs.move_to_end(key)
                recorded.ids.copy_(ids)
                recorded.position.fill_(position)
            recorded.graph.replay()
            return recorded.logits.clone(), recorded.hidden.clone()

    def _record(self, ids: torch.Tensor, position: int, buffers: tuple[torch.Tensor, ...]) -> _Recorded:
        """Warm up on a side stream, then record one step (recording runs nothing: the caller replays).
        The warm-up passes write this step's key and value at `position`, as the replay will."""
        static_ids = ids.clone()
        static_position = torch.full((1,), position, dtype=torch.int64, device=ids.device)
        side = torch.cuda.Stream(ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                self.body(static_ids, static_position, *buffers)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, hidden = self.body(static_ids, static_position, *buffers)
        self.recordings += 1
        return _Recorded(graph, static_ids, static_position, logits, hidden, buffers)


def graphs_apply(device: torch.device, row_invariant: bool) -> bool:
    """Graphs replace the eager one-token step on a CUDA device where the pass is not row-invariant.

    A row-invariant pass (16-bit dtypes) computes each verification row exactly as its own
    one-token step does, attending over exactly the live slots; a graph's fixed-shape attention
    over the whole capacity rounds differently, and in 16 bits that flips tokens."""
    return device.type == "cuda" and torch.cuda.is_available() and not row_invariant
