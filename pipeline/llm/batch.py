"""Batched speculative decoding: one target forward pass verifies every active request's draft.

One GPU serves many avatars, and a target pass over B rows costs far less than B passes
(the weights are read once). Each row keeps its own drafter, draft length, sampling
options, RNG and stopping rules, exactly as in the single-request `Generator`
(pipeline/llm/engine.py); only the verification forward is shared.

The rows share one KV cache (the lean pass's preallocated `KVCache`, or transformers'
`DynamicCache` where the target runs through its own modules) whose slots are physical: each step
appends T = max(γ_r) + 1 slots to every row, a row with a shorter draft pads, and a row
that accepts n of its γ_r drafted tokens keeps n + 1 of them. The slots a row does not
keep (padding, the rejected tail) become holes in a 2-D attention mask, and each row's
tokens carry explicit position ids (their index in that row's own sequence), so the
rotary embeddings and the attention a row sees are those of the row decoded alone
(ragged acceptance, Leviathan et al. 2023 per row). When holes pile up the cache is
compacted: each row's kept slots are gathered, in order, to the right. A request joins
by a prefill of its own (on its session's cached prefix, where the generator keeps one),
left-padded to the batch's length and concatenated along the batch dimension; a finished or
cancelled one leaves by `index_select`, its live slots gathered into the session's cache.

Invariant per row, as in engine.py: the cache holds every token of the row's context but
the last.

First phrases first. On a CPU a pass costs about what its positions cost (the int4 kernels
sweep a few positions per read of the weights), so a reply that has not yet written its first
phrase, which a listener is waiting for, steps several times slower beside three replies
that are seconds ahead of their playback. With `urgent_tokens` set, while any row has
written fewer tokens than that, the rows that have written `park_min_tokens` or more sit the
steps out: *parked*, their live keys and values set aside, they rejoin (as a prefilled
request joins) at the first step with no urgent row. Parking changes when a row steps,
never what it computes: its context, cache and drafter state are the same afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import torch

from pipeline.llm.draft_length import DraftGuard, VerifyCost
from pipeline.llm.engine import DecodeStep, GenerationRequest, Generator, RequestDecoder
from pipeline.llm.kv_cache import cache_like, layer_tensors, replace_layers
from pipeline.llm.lean_llama import LeanLlama

COMPACT_MIN_HOLES = 32  # compact once every row has at least this many dead slots …
COMPACT_FRACTION = 0.25  # … and they are this share of the cache
# Rows × (longest draft + 1) a verification pass may hold; None: no cap. Padded to the longest
# draft, a batch's pass grows with rows × γ, and past a few dozen positions a CPU pass is
# bound by arithmetic, so long drafts for many rows cost more than they commit.
MAX_VERIFY_TOKENS: int | None = None


@dataclass
class BatchCounters:
    steps: int = 0
    rows_verified: int = 0  # Σ over steps of the rows in that step
    padded_slots: int = 0  # slots computed only to square the batch
    compactions: int = 0
    ragged_steps: int = 0  # steps whose rows drafted different lengths
    widths: list[int] = field(default_factory=list)  # rows per step
    largest_pass: int = 0  # the most positions (rows × (longest draft + 1)) one pass verified
    parked: int = 0  # rows set aside while an urgent row stepped (First phrases first)


class BatchedDecoder:
    """Advances up to `max_batch_size` requests together, one target forward per step.

    `add` prefills a request and joins it to the batch; `step` runs one draft-and-verify
    step for every row and returns each row's DecodeStep. A row whose step is its last
    (EOS, stop string, length, cancellation) has left the batch when `step` returns.
    Not thread-safe: call it from one thread (the model worker).
    """

    def __init__(self, generator: Generator, max_batch_size: int = 8,
                 max_verify_tokens: int | None = MAX_VERIFY_TOKENS, urgent_tokens: int = 0,
                 park_min_tokens: int = 0) -> None:
        """`urgent_tokens`: a row with fewer new tokens than this steps without the rows that have
        `park_min_tokens` or more (see the module docstring); 0: every row steps every time."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if urgent_tokens and park_min_tokens < urgent_tokens:
            raise ValueError("park_min_tokens must be at least urgent_tokens: an urgent row is never parked")
        self.generator, self.loaded = generator, generator.loaded
        self.max_batch_size = max_batch_size
        self.max_verify_tokens = max_verify_tokens
        self.urgent_tokens, self.park_min_tokens = urgent_tokens, park_min_tokens
        self.rows: list[RequestDecoder] = []
        self.parked: list[tuple[RequestDecoder, object]] = []  # rows sitting steps out, each with its own cache
        self._over: list[tuple[RequestDecoder, DecodeStep]] = []  # resumed requests over before they start
        self.cache = None  # a KVCache or DynamicCache, [B, H, L, D] per layer, or None while L = 0
        self.kept = torch.zeros((0, 0), dtype=torch.bool, device=self.loaded.device)  # [B, L]: live slots
        tokenizer = self.loaded.tokenizer
        self.pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.counters = BatchCounters()
        # Drafting on or off for the whole batch, from what its steps measured (the rows' own guards
        # time passes of one row): a drafting step's seconds (every row's drafting, the pass) per
        # committed token against a plain pass of the batch's rows per row, from a line fitted
        # through pass time over positions (rows × width).
        self.guard = DraftGuard()
        self.pass_cost = VerifyCost()
        self.features: torch.Tensor | None = None  # the last pass's features, which head drafters read

    @property
    def max_gamma(self) -> int:
        """The longest draft any row may verify this step: the pass's width times its rows stays in budget."""
        if self.max_verify_tokens is None:
            return 1 << 30
        return max(0, self.max_verify_tokens // max(1, len(self.rows)) - 1)

    @property
    def room(self) -> int:
        return self.max_batch_size - len(self.rows) - len(self.parked)

    @property
    def active(self) -> bool:
        """Rows left to step, parked ones included."""
        return bool(self.rows or self.parked)

    @torch.inference_mode()
    def add(self, request: GenerationRequest, should_stop: Callable[[], bool] = lambda: False) -> RequestDecoder:
        if self.room <= 0:
            raise RuntimeError(f"the batch is full ({self.max_batch_size} rows)")
        self.generator.check(request)
        row = RequestDecoder(self.generator, request, should_stop)
        over = row.over_at_start()
        if over is not None:  # its last step comes with the next `step`; it never joins
            self._over.append((row, over))
            return row
        cache = self.generator.prefill(row)
        if cache is not None:
            _require_full_attention(cache)
        self._join(cache, len(row.context) - 1)
        self.rows.append(row)
        return row

    def clear(self) -> None:
        """Drop every row and the cache (after a failed step, whose state cannot be trusted)."""
        self.rows, self.cache, self.kept, self._over, self.parked = [], None, self.kept[:0, :0], [], []

    @torch.inference_mode()
    def drop_stopped(self) -> list[tuple[RequestDecoder, DecodeStep]]:
        """Cancel the rows whose `should_stop` says so, parked ones too: each leaves with its last step."""
        stopped = [i for i, row in enumerate(self.rows) if row.should_stop()]
        out, self._over = [*self._over, *((self.rows[i], self.rows[i].cancelled()) for i in stopped)], []
        self._leave(stopped)
        for row, cache in [p for p in self.parked if p[0].should_stop()]:
            self.parked.remove((row, cache))
            out.append((row, row.cancelled()))
            if self._keeps_session(row) and cache is not None:
                self.generator.remember(row, cache)
        return out

    @torch.inference_mode()
    def step(self) -> list[tuple[RequestDecoder, DecodeStep]]:
        out = self.drop_stopped()
        self._park_or_rejoin()
        if not self.rows:
            return out
        drafting = self.guard.drafting() if any(row.guard is not None for row in self.rows) else None
        trees = isinstance(self.generator.forward, LeanLlama)  # its passes take a tree's attention mask
        for row in self.rows:
            row.propose(self.max_gamma, drafting, tree=trees)
        logits, target_s = self._verify_forward()
        finished = []
        root = self.kept.shape[1] - logits.shape[1]  # the slot of each row's last context token
        for i, row in enumerate(self.rows):
            n = row.verify(logits[i, : len(row.draft) + 1], target_s, own_pass=False,
                           features=None if self.features is None else self.features[i, : len(row.draft) + 1])
            if row.tree is None:
                self.kept[i, root + n + 1:] = False  # the rejected tail and padding
            else:  # a tree's accepted path stays where the pass wrote it: later passes skip the holes
                path = torch.zeros(logits.shape[1], dtype=torch.bool, device=self.kept.device)
                path[[0, *(1 + node for node in row.kept)]] = True
                self.kept[i, root:] &= path
            step = row.emit()
            out.append((row, step))
            if step.finish_reason:
                finished.append(i)
        self._judge(drafting, target_s, logits.shape[1])
        self._leave(finished)
        self._maybe_compact()
        return out

    def _judge(self, drafting: bool | None, target_s: float, width: int) -> None:
        """After the rows' verification: the pass's time at its positions, and a drafting step's
        cost (every row's drafting and the pass) per token the rows committed, for the guard."""
        rows = len(self.rows)
        self.pass_cost.observe(rows * width, target_s)
        if drafting:
            # the rate rule only where a model drafter drafts (DraftGuard.judges_rate)
            self.guard.judges_rate = any(row.guard is not None and not row.drafter.model_free for row in self.rows)
            plain = self.pass_cost.seconds(rows)
            self.guard.observe(target_s + sum(row.draft_s for row in self.rows),
                               sum(len(row.committed) for row in self.rows), None if plain is None else plain / rows)

    def _verify_forward(self) -> tuple[torch.Tensor, float]:
        """One target pass over [last, x_1..x_γ] of every row, padded to the longest: logits [B, T, V]."""
        width = max(len(row.draft) for row in self.rows) + 1
        ids = torch.full((len(self.rows), width), self.pad_id, dtype=torch.long)
        live = torch.zeros((len(self.rows), width), dtype=torch.bool)
        positions = torch.zeros((len(self.rows), width), dtype=torch.long)
        for i, row in enumerate(self.rows):
            tokens = [row.context[-1], *row.draft]
            ids[i, : len(tokens)] = torch.tensor(tokens)
            live[i, : len(tokens)] = True
            positions[i] = torch.arange(len(row.context) - 1, len(row.context) - 1 + width)
            if row.tree is not None:
                positions[i, : len(tokens)] = torch.tensor(row.tree.positions(len(row.context) - 1))
        device = self.loaded.device
        live = live.to(device)
        mask = torch.cat([self.kept, live], dim=1)
        extra = {"attention_mask": mask.long()}
        if any(row.tree is not None for row in self.rows):
            extra = {"visible": self._tree_mask(width, live)}
        started = time.perf_counter()
        result = self.generator.forward(input_ids=ids.to(device), position_ids=positions.to(device),
                                        cache=self.cache, use_cache=True, logits_to_keep=width, **extra)
        logits = result.logits
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the stats time the pass, not its launch
        target_s = time.perf_counter() - started
        self.cache = result.cache
        self.features = getattr(result, "hidden", None)  # [B, T, D] for head drafters (`LeanOutput.hidden`)
        self.kept = mask
        counters = self.counters
        counters.steps += 1
        counters.rows_verified += len(self.rows)
        counters.padded_slots += int((~live).sum())
        counters.ragged_steps += len({len(row.draft) for row in self.rows}) > 1
        counters.widths.append(len(self.rows))
        counters.largest_pass = max(counters.largest_pass, ids.numel())
        return logits, target_s

    def _tree_mask(self, width: int, live: torch.Tensor) -> torch.Tensor:
        """Bool [B, width, L + width]: every query sees its row's live slots, then, among the new
        ones, a tree row's nodes their ancestors (token_tree.TokenTree.visible) and a draft's tokens
        those before them; a padding query sees its row's new tokens (its output is never read)."""
        rows = len(self.rows)
        new = torch.ones((rows, width, width), dtype=torch.bool).tril()
        for i, row in enumerate(self.rows):
            if row.tree is not None:
                n = len(row.tree) + 1
                new[i, :n, :n] = row.tree.visible(0)
        new = new.to(live.device) & live[:, None, :]
        return torch.cat([self.kept[:, None, :].expand(rows, width, self.kept.shape[1]), new], dim=2)

    def _join(self, cache, length: int) -> None:
        """Concatenate a prefilled row along the batch, left-padding the shorter side with dead slots."""
        device = self.loaded.device
        batch_length = self.kept.shape[1]
        total = max(batch_length, length)
        kept_new = torch.zeros((1, total), dtype=torch.bool, device=device)
        kept_new[0, total - length:] = True
        kept_old = torch.cat([torch.zeros((self.kept.shape[0], total - batch_length), dtype=torch.bool,
                                          device=device), self.kept], dim=1)
        base = self.cache if self.cache is not None else cache
        if base is not None:
            old = layer_tensors(self.cache) if self.cache is not None else None
            new = layer_tensors(cache) if cache is not None else None
            pairs = []
            for i, (template, _) in enumerate(layer_tensors(base)):
                keys, values = (torch.cat([_left_pad(old[i][j] if old else None, len(self.rows), total, template),
                                           _left_pad(new[i][j] if new else None, 1, total, template)], dim=0)
                                for j in (0, 1))
                pairs.append((keys, values))
            self.cache = replace_layers(base, pairs)
        self.kept = torch.cat([kept_old, kept_new], dim=0)

    def _park_or_rejoin(self) -> None:
        """While a row is urgent the rows far enough along are parked; with none urgent, they rejoin."""
        if not self.urgent_tokens:
            return
        if any(_new_tokens(row) < self.urgent_tokens for row in self.rows):
            far = [i for i, row in enumerate(self.rows) if _new_tokens(row) >= self.park_min_tokens]
            self.parked += [(self.rows[i], self._live_cache(i)) for i in far]
            self._leave(far, remember=False)
            self.counters.parked += len(far)
            return
        parked, self.parked = self.parked, []
        for row, cache in parked:
            self._join(cache, len(row.context) - 1)
            self.rows.append(row)

    def _leave(self, indices: list[int], remember: bool = True) -> None:
        if not indices:
            return
        for i in indices if remember else ():
            self._remember(i)
        gone = set(indices)
        stay = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in stay]
        if not self.rows:  # the parked rows, if any, keep caches of their own
            self.cache, self.kept = None, self.kept[:0, :0]
            return
        index = torch.tensor(stay, device=self.loaded.device)
        self.kept = self.kept.index_select(0, index)
        if self.cache is not None:
            self.cache = replace_layers(self.cache, [(k.index_select(0, index), v.index_select(0, index))
                                                     for k, v in layer_tensors(self.cache)])
        self._maybe_compact()

    def _remember(self, i: int) -> None:
        """Hand row i's keys and values (its live slots, in order) to the generator's prefix cache."""
        if self._keeps_session(self.rows[i]) and self.cache is not None:
            self.generator.remember(self.rows[i], self._live_cache(i))

    def _keeps_session(self, row: RequestDecoder) -> bool:
        """The generator keeps this row's session in its prefix cache when the row leaves."""
        return bool(self.generator.prefix_cache.sessions and row.request.session_key)

    def _live_cache(self, i: int):
        """Row i's keys and values, its live slots in order, as a cache of its own (None: no cache yet)."""
        if self.cache is None:
            return None
        live = self.kept[i].nonzero().squeeze(1)
        pairs = [(k[i : i + 1].index_select(2, live), v[i : i + 1].index_select(2, live))
                 for k, v in layer_tensors(self.cache)]
        return cache_like(self.cache, pairs, self.loaded.model.config)

    def _maybe_compact(self) -> None:
        """Gather each row's live slots, in order, to the right end of a shorter cache."""
        if self.cache is None or not self.rows:
            return
        length = self.kept.shape[1]
        live = int(self.kept.sum(dim=1).max())
        holes = length - live
        if holes < COMPACT_MIN_HOLES or holes < COMPACT_FRACTION * length:
            return
        order = torch.sort(self.kept.to(torch.int8), dim=1, stable=True).indices[:, holes:]  # dead first, then live
        self.kept = torch.gather(self.kept, 1, order)
        pairs = []
        for keys, values in layer_tensors(self.cache):
            b, h, _, d = keys.shape
            index = order[:, None, :, None].expand(b, h, live, d)
            pairs.append((torch.gather(keys, 2, index), torch.gather(values, 2, index)))
        self.cache = replace_layers(self.cache, pairs)
        self.counters.compactions += 1


def _new_tokens(row: RequestDecoder) -> int:
    """Tokens of the reply so far, those of a resumed log included."""
    return len(row.context) - row.prompt_len


def _left_pad(tensor: torch.Tensor | None, rows: int, length: int, template: torch.Tensor | None) -> torch.Tensor:
    """[rows, H, length, D]: `tensor` right-aligned after zeros (dead slots, masked out)."""
    assert template is not None
    b, h, _, d = template.shape
    current = 0 if tensor is None else tensor.shape[2]
    zeros = template.new_zeros((rows, h, length - current, d))
    return zeros if tensor is None else torch.cat([zeros, tensor], dim=2)


def _require_full_attention(cache) -> None:
    if any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in cache.layers):
        raise ValueError("batched decoding needs a model whose cache layers are full attention (no sliding window)")


class BatchScheduler:
    """Gathers concurrent requests into one running batch for asyncio callers.

    Each `steps()` caller gets its own async iterator of DecodeSteps; one loop task runs
    batch steps through `run_in_worker` (the model's thread), admitting waiting requests
    between steps as rows leave. With the batch full, new requests wait their turn.
    """

    def __init__(self, decoder: BatchedDecoder,
                 run_in_worker: Callable[..., Awaitable]) -> None:
        self.decoder = decoder
        self.run_in_worker = run_in_worker
        self._waiting: list[_Pending] = []
        self._queues: dict[object, asyncio.Queue] = {}  # row (or a failed _Pending) -> its caller's queue
        self._loop_task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        """Requests are decoding or waiting to join."""
        return bool(self._waiting) or self.decoder.active

    async def steps(self, request: GenerationRequest,
                    should_stop: Callable[[], bool] = lambda: False) -> AsyncIterator[DecodeStep]:
        pending = _Pending(request, should_stop, asyncio.Queue())
        self._waiting.append(pending)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                item = await pending.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            pending.abandoned = True  # a row whose caller left is cancelled at the next step

    async def _run(self) -> None:
        while self._waiting or self.decoder.active:
            admit = self._waiting[: self.decoder.room]
            del self._waiting[: len(admit)]
            try:
                results = await self.run_in_worker(self._tick, admit)
            except Exception as e:  # noqa: BLE001 - the batch is lost: every caller hears why
                for queue in [*self._queues.values(), *(p.queue for p in admit)]:
                    queue.put_nowait(e)
                self._queues.clear()
                self.decoder.clear()
                continue
            for key, item in results:
                queue = self._queues[key]
                queue.put_nowait(item)
                if isinstance(item, BaseException) or item.finish_reason is not None:
                    del self._queues[key]

    def _tick(self, admit: list[_Pending]) -> list[tuple[object, DecodeStep | BaseException]]:
        """In the worker thread: cancelled rows leave, the admitted requests join, then one batch step.

        Rows leave first so that a request replacing a cancelled one of its session (a turn
        restarted on the final transcript) finds the session's prefix cache they leave behind."""
        results: list[tuple[object, DecodeStep | BaseException]] = list(self.decoder.drop_stopped())
        for pending in admit:
            def stop(p: _Pending = pending) -> bool:
                return p.abandoned or p.should_stop()
            try:
                row = self.decoder.add(pending.request, stop)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                self._queues[pending] = pending.queue
                results.append((pending, e))
                continue
            self._queues[row] = pending.queue
        return results + [(row, step) for row, step in self.decoder.step()]


@dataclass(eq=False)
class _Pending:
    request: GenerationRequest
    should_stop: Callable[[], bool]
    queue: asyncio.Queue
    abandoned: bool = False
