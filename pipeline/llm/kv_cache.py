"""A preallocated KV cache for the lean pass, where rollback moves a position (as gpt-fast does).

transformers' `DynamicCache` concatenates every layer's keys and values with each step's
(a new tensor per layer per step, copying the whole cache) and slices them on a crop. Here
all layers' keys live in one buffer `[layers, B, H_kv, capacity, D]` (and their values in
another) written in place at slot `length`; `crop` only moves `length` back, so dropping a
rejected draft copies nothing. The buffers grow by `CHUNK_TOKENS` slots at a time (one copy
per chunk, never per step), or are sized up front with `reserve`.

It answers what the engine and its helpers ask of a cache: `get_seq_length`, `crop`
(transformers' convention: a negative count drops that many), `update(k, v, layer)` in
`DynamicCache`'s way (layer 0 first in each pass: it claims the new slots), and `layers`,
views `[B, H_kv, length, D]` of each layer's live slots, and `batch_repeat_interleave` (the
end-of-turn scorer's). The batch's surgery (rows joining,
leaving, compaction: pipeline/llm/batch.py) goes through `layer_tensors` and `replace_layers`,
which serve a `DynamicCache` too (the transformers model still fills those).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

CHUNK_TOKENS = 128  # slots added at a time: 5.9 MB a row for the bundled target in float32, one copy per 128 tokens


class LayerView(NamedTuple):
    keys: torch.Tensor  # [B, H_kv, length, D]
    values: torch.Tensor


class KVCache:
    """Keys and values of `layers` layers in `[layers, B, H_kv, capacity, D]` buffers, `length` slots live."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = CHUNK_TOKENS) -> None:
        shape = (layers, batch, kv_heads, _chunked(capacity), head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, C, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        # its buffers are lent (the CUDA graphs' `cuda_graph_step.GraphBuffers`): they go back when the
        # cache is dropped, so a cache kept past its reply moves to buffers of its own (`move_to_own`)
        self.borrowed = False

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    def get_seq_length(self, layer: int = 0) -> int:
        return self.length

    def reserve(self, total: int) -> None:
        """Room for `total` slots without a copy (the buffers grow to the next whole chunk)."""
        if total > self.capacity:
            size = _chunked(total)
            self.keys, self.values = _grown(self.keys, size), _grown(self.values, size)
            self.borrowed = False

    def move_to(self, keys: torch.Tensor, values: torch.Tensor, borrowed: bool = False) -> None:
        """Hold the live slots in `keys` and `values` from now on: buffers of this layout with room
        for them (`borrowed`: lent by the CUDA graphs' `cuda_graph_step.GraphBuffers`)."""
        keys[:, :, :, : self.length] = self.keys[:, :, :, : self.length]
        values[:, :, :, : self.length] = self.values[:, :, :, : self.length]
        self.keys, self.values, self.borrowed = keys, values, borrowed

    def move_to_own(self) -> None:
        """Hold the live slots in new buffers of its own, with a chunk to spare."""
        shape = (*self.keys.shape[:3], _chunked(self.length + CHUNK_TOKENS), self.keys.shape[4])
        self.move_to(self.keys.new_zeros(shape), self.values.new_zeros(shape))

    def __deepcopy__(self, memo: dict) -> KVCache:
        """A copy of the live slots in buffers of its own (not a copy of a lent buffer's whole capacity)."""
        twin = copy.copy(self)
        twin.move_to_own()
        return twin

    def extend(self, new: int) -> int:
        """Claim `new` slots after the live ones (growing the buffers if need be); returns the first."""
        start = self.length
        self.reserve(start + new)
        self.length = start + new
        return start

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> LayerView:
        """Store [B, H_kv, new, D] at slots start.. of `layer`; returns its slots up to them."""
        end = start + keys.shape[2]
        self.keys[layer, :, :, start:end] = keys
        self.values[layer, :, :, start:end] = values
        return LayerView(self.keys[layer, :, :, :end], self.values[layer, :, :, :end])

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> LayerView:
        """`DynamicCache.update`'s contract: layer 0 of a pass claims the new slots, the others fill them."""
        new = keys.shape[2]
        start = self.extend(new) if layer == 0 else self.length - new
        return self.write(layer, start, keys, values)

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` slots (negative: drop that many); nothing is copied."""
        if max_length < 0:
            max_length = self.length + max_length
        self.length = max(0, min(self.length, max_length))

    def keep_slots(self, first: int, slots: Sequence[int]) -> None:
        """Move the keys and values at `slots` (ascending, each at or past `first`) to slots first,
        first + 1, ... and drop everything after them: a verified token tree keeps its accepted path."""
        if list(slots) != list(range(first, first + len(slots))):
            index = torch.tensor(list(slots), device=self.keys.device)
            for buffer in (self.keys, self.values):
                buffer[:, :, :, first : first + len(slots)] = buffer[:, :, :, index]
        self.length = first + len(slots)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times, in place (`DynamicCache`'s; the end-of-turn scorer's marks)."""
        self.keys = self.keys.repeat_interleave(repeats, dim=1)
        self.values = self.values.repeat_interleave(repeats, dim=1)
        self.borrowed = False

    @property
    def layers(self) -> list[LayerView]:
        return [LayerView(k[:, :, : self.length], v[:, :, : self.length])
                for k, v in zip(self.keys.unbind(0), self.values.unbind(0), strict=True)]

    @classmethod
    def from_tensors(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], spare: int = CHUNK_TOKENS) -> KVCache:
        """A cache holding these [B, H_kv, L, D] keys and values per layer, with room for `spare` more."""
        first = pairs[0][0]
        b, h, length, d = first.shape
        cache = cls(len(pairs), b, h, d, first.dtype, first.device, capacity=length + spare)
        for layer, (k, v) in enumerate(pairs):
            cache.write(layer, 0, k, v)
        cache.length = length
        return cache


def layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's live keys and values [B, H_kv, L, D], of a `KVCache` or a `DynamicCache`."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def replace_layers(cache: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`cache` holding `pairs` instead (any batch size and length): a new `KVCache` for a
    `KVCache` (the batch's surgery is rare: a copy there spares every step one), else the
    `DynamicCache` with its layers' tensors set."""
    if isinstance(cache, KVCache):
        return KVCache.from_tensors(pairs)
    for layer, (k, v) in zip(cache.layers, pairs, strict=True):
        layer.keys, layer.values = k, v
    return cache


def cache_like(cache: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], config: Any) -> Any:
    """A new cache of `cache`'s kind holding `pairs` (a `DynamicCache` for `config`'s model, else a `KVCache`)."""
    if isinstance(cache, KVCache):
        return KVCache.from_tensors(pairs)
    from transformers import DynamicCache

    out = DynamicCache(config=config)
    for layer, (k, v) in enumerate(pairs):
        out.update(k, v, layer)
    return out


def _chunked(slots: int) -> int:
    return max(1, -(-slots // CHUNK_TOKENS)) * CHUNK_TOKENS


def _grown(buffer: torch.Tensor, size: int) -> torch.Tensor:
    grown = buffer.new_zeros((*buffer.shape[:3], size, buffer.shape[4]))
    grown[:, :, :, : buffer.shape[3]] = buffer
    return grown
