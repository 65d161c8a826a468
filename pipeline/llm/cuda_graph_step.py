"""Decoding and verification passes replayed as CUDA graphs, where a GPU pass is launch overhead.

On an H200 a plain step of the bundled 135M target took ~14 ms eagerly (docs/benchmarks/history.md,
"GPU check"): a pass of 0.3 GFLOP spread over some 400 kernels, each launched from Python, and a
verification pass of a few rows costs the same launches. A CUDA graph records those launches
once and replays them with one call (gpt-fast reaches the same end with
`torch.compile(mode="reduce-overhead")`; vLLM records one graph per batch size). A graph fixes
its tensors' shapes and addresses, so the pass it records (`LeanLlama._graph_body`) takes its
tokens' positions and cache slots from device tensors, writes the new keys and values at those
slots (`index_copy_`) and attends over the cache's whole capacity, masked to what each token
may see: the slots before the pass and its own ancestors among the pass's tokens (a chain's
earlier tokens, or a token tree's path, Miao et al. 2024).

A graph is recorded per pass length (1 for a plain step, 1 + draft for a verification) and per
cache buffer. So that a new reply does not record again, a reply's cache moves into one of a few
buffers of a fixed capacity that `GraphBuffers` hands from reply to reply (vLLM and gpt-fast keep
one static cache for the same reason). Graphs are kept least recently used first, up to
`MAX_GRAPHS`; their intermediate memory is one pool they share, which is safe because replays are
serialized and each replay's outputs are copied out before the next.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.llm.kv_cache import KVCache
from pipeline.llm.options import GRAPH_CACHE_TOKENS

GRAPH_BUFFERS = 4  # such buffers: replies decoding at once with graphs (another one runs eagerly)
MAX_GRAPHS = 64  # graphs kept: pass lengths × buffers
# the longest pass recorded: a verification of a 16-token draft or tree (engine.TREE_MAX_NODES) and the
# token before it; longer passes (a prompt's prefill) run eagerly, each length being rare
MAX_GRAPHED_TOKENS = 17
WARMUP_PASSES = 2  # eager passes on a side stream before recording (cuBLAS and the allocator settle)

# body(ids [1, n], where [2, n] int64 (positions, slots), ancestors [n, n] bool, *buffers)
#   -> (logits [1, n, V], hidden [1, n, hidden_size])
PassBody = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class _RecordingClock:
    """Seconds spent recording graphs, every `GraphedPass` of the process together."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds


_RECORDING = _RecordingClock()


class Stopwatch:
    """Seconds since it started, less what recording CUDA graphs took meanwhile.

    A pass that records a graph costs some twenty replays (warm-up passes and the capture), once;
    the engine's cost model learns a pass's price from its time, and a recording taken for that
    price turned drafting off on an H200 (the guard saw a verification pass cost 20 steps)."""

    def __init__(self) -> None:
        self.started, self.recorded = time.perf_counter(), _RECORDING.seconds

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started - (_RECORDING.seconds - self.recorded)


@dataclass
class _Recorded:
    graph: Any  # a torch.cuda.CUDAGraph (a test's stand-in off a GPU)
    inputs: tuple[torch.Tensor, ...]  # the graph's inputs, written before each replay
    outputs: tuple[torch.Tensor, ...]  # its outputs, overwritten by each replay
    # No reference to the buffers it reads and writes: a graph is replayed only for buffers at the
    # very addresses, shapes and strides it was recorded with (its key), so it touches only memory
    # its caller holds; a reference would keep a `GraphBuffers` buffer from ever being free again.


def buffers_key(buffers: tuple[torch.Tensor, ...]) -> tuple:
    """What a graph over `buffers` depends on: their addresses, shapes, strides and dtypes."""
    return tuple((b.data_ptr(), tuple(b.shape), b.stride(), b.dtype) for b in buffers)


class GraphSet:
    """`body(*constants, *inputs, *buffers) -> outputs` recorded as one CUDA graph per key and replayed: `run`
    computes what `body` computes, as one launch. Graphs are kept least recently used first, up to
    `max_graphs`; a key must name everything the recording depends on but the inputs' values
    (their shapes, the buffers' addresses: `buffers_key`)."""

    def __init__(self, body: Callable[..., tuple[torch.Tensor, ...]], max_graphs: int = MAX_GRAPHS) -> None:
        self.body, self.max_graphs = body, max_graphs
        self.graphs: OrderedDict[tuple, _Recorded] = OrderedDict()
        self.recordings = 0  # graphs recorded so far (tests and benchmarks read it)
        self._pool: Any = None  # the graphs' shared memory pool, made at the first recording
        self._lock = threading.Lock()  # a replay and the copies of its outputs happen together

    def run(self, key: tuple, inputs: tuple[torch.Tensor, ...], buffers: tuple[torch.Tensor, ...],
            read: Callable[[tuple[torch.Tensor, ...]], Any], constants: tuple = ()) -> Any:
        """Replay the graph of `key` (recorded now if it is not yet) on `inputs` and return what
        `read` takes from its outputs: fresh tensors, since the next replay overwrites them. The first
        input is on the graph's device; the others may be host tensors (copied in before each replay).
        `constants`: Python values the recording depends on (a loop's length), passed to the body
        first; the key must name them."""
        with self._lock:
            recorded = self.graphs.get(key)
            if recorded is None:
                recorded = self._record(constants, inputs, buffers)
                self.graphs[key] = recorded
                while len(self.graphs) > self.max_graphs:
                    self.graphs.popitem(last=False)
            else:
                self.graphs.move_to_end(key)
                for static, value in zip(recorded.inputs, inputs, strict=True):
                    static.copy_(value)
            self._replay(recorded, buffers)
            return read(recorded.outputs)

    def _replay(self, recorded: _Recorded, buffers: tuple[torch.Tensor, ...]) -> None:
        """Run the recorded graph (it reads and writes `buffers` by the addresses it was recorded with)."""
        recorded.graph.replay()

    def _record(self, constants: tuple, inputs: tuple[torch.Tensor, ...], buffers: tuple[torch.Tensor, ...]
                ) -> _Recorded:
        """One graph recorded (`_capture`), its seconds on the recording clock (`Stopwatch`)."""
        device = inputs[0].device  # the first input is on the graph's device; the others may be on the host
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)  # the work queued before is the caller's, not the recording's
        started = time.perf_counter()
        body = functools.partial(self.body, *constants)
        recorded = self._capture(body, tuple(t.to(device, copy=True) for t in inputs), buffers)
        if cuda:
            torch.cuda.synchronize(device)
        _RECORDING.add(time.perf_counter() - started)
        self.recordings += 1
        return recorded

    def _capture(self, body: Callable[..., tuple[torch.Tensor, ...]], static: tuple[torch.Tensor, ...],
                 buffers: tuple[torch.Tensor, ...]) -> _Recorded:
        """Warm up on a side stream, then record (recording runs nothing: the caller replays). The
        warm-up runs write into the buffers what the replay will (a pass's keys and values at its slots)."""
        device = static[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                body(*static, *buffers)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = body(*static, *buffers)
        return _Recorded(graph, static, tuple(outputs))


class GraphedPass(GraphSet):
    """A decoding pass (`body`) recorded once per pass length, pass kind (a chain or a tree) and set
    of buffers, and replayed."""

    def __init__(self, body: PassBody, max_graphs: int = MAX_GRAPHS) -> None:
        super().__init__(body, max_graphs)
        self._chains: dict[tuple[int, torch.device], torch.Tensor] = {}  # a chain's ancestors, by length

    def __call__(self, ids: torch.Tensor, start: int, positions: list[int] | None, ancestors: torch.Tensor | None,
                 keep: int, *buffers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and hidden states of the last `keep` of tokens `ids` [1, n] written at slots
        start.., fresh tensors. A chain (`positions` and `ancestors` None): the tokens follow each
        other at positions start... A tree: each token at its own position, seeing the cache
        before `start` and the pass's tokens marked in its row of `ancestors` [n, n]."""
        n = ids.shape[1]
        key = (n, ancestors is not None, *buffers_key(buffers))
        if ancestors is None:  # a chain's: each token sees itself and those before it
            ancestors = self._chains.get((n, ids.device))
            if ancestors is None:
                ancestors = self._chains[n, ids.device] = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        slots = list(range(start, start + n))
        where = torch.tensor([slots if positions is None else positions, slots], dtype=torch.int64)
        return self.run(key, (ids, where, ancestors), buffers,
                        lambda out: (out[0][:, n - keep :].clone(), out[1][:, n - keep :].clone()))


class GraphBuffers:
    """Up to `count` KV cache buffers of `capacity` slots, handed from reply to reply, so that the
    graphs recorded over one serve every reply that holds it later.

    A buffer is free when nothing but this object holds its memory: a cache placed in it holds a
    view, and so does anything cut from that cache (`torch`'s storage use count says so), so a
    cache that is dropped frees its buffer and a buffer is never handed out while anything can
    still read it. The buffers live as long as this object: a graph never writes into memory that
    was freed and handed out again. A cache kept past its reply (a session's, in the prefix cache)
    moves to buffers of its own (`KVCache.borrowed`, `KVCache.move_to_own`)."""

    def __init__(self, capacity: int = GRAPH_CACHE_TOKENS, count: int = GRAPH_BUFFERS) -> None:
        self.capacity, self.count = capacity, count
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._alone = 0  # a buffer's storage use count with nothing but this object holding it

    def holds(self, cache: KVCache) -> bool:
        return any(cache.keys.data_ptr() == keys.data_ptr() for keys, _ in self.buffers)

    def place(self, cache: KVCache, needed: int) -> bool:
        """Whether `cache` is in one of the buffers, moved into a free one if it was not; false when
        `needed` slots do not fit or every buffer is taken (the pass then runs eagerly)."""
        if needed > self.capacity or cache.batch != 1:
            return False
        if self.holds(cache):
            return True
        shape = (*cache.keys.shape[:3], self.capacity, cache.keys.shape[4])
        free = [pair for pair in self.buffers if pair[0].shape == shape and self._free(*pair)]
        if not free and len(self.buffers) < self.count:
            self.buffers.append((cache.keys.new_zeros(shape), cache.values.new_zeros(shape)))
            self._alone = _uses(self.buffers[-1][0])
            free = self.buffers[-1:]
        if not free:
            return False
        keys, values = free[0]
        cache.move_to(keys.view(shape), values.view(shape), borrowed=True)  # views: their hold shows in the use count
        return True

    def _free(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Nothing but this object's own tensors refers to the buffers' memory."""
        return _uses(keys) == _uses(values) == self._alone


def _uses(buffer: torch.Tensor) -> int:
    """How many tensors (views included) hold the buffer's memory, plus what asking adds."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


def graphs_apply(device: torch.device, row_invariant: bool) -> bool:
    """Graphs replace eager decoding and verification passes on a CUDA device where the pass is not
    row-invariant.

    A row-invariant pass (16-bit dtypes) computes each verification row exactly as its own
    one-token step does, attending over exactly the live slots; a graph's fixed-shape attention
    over the whole capacity rounds differently, and in 16 bits that flips tokens."""
    return device.type == "cuda" and torch.cuda.is_available() and not row_invariant
