"""A lean forward pass for Llama-architecture targets, on the model's own weights.

A decoding step of SmolLM2-135M through transformers' modules took ~48 ms on 2 CPU cores
(float32), of which the matrix products were ~26 ms: the rest was the machinery around
them (a mask built per call, rotary angles recomputed per call, output capture hooks,
per-module dispatch, three products where one would do). This pass does the same
arithmetic as `LlamaForCausalLM` with fewer, larger operations, in the style of gpt-fast:

- q, k and v are one matrix product, and so are the MLP's gate and up projections. The
  fused weights are allocated once and the model's own parameters are made views into
  them, so nothing is copied and the transformers model (early-exit drafting, Hugging
  Face `generate` in the benchmarks) keeps working on the same memory;
- rotary cos/sin come from a table computed once per position;
- the causal mask is built only when a pass has several tokens or padded rows;
- the weights' products go through the kernel their form wants (`weight_kernels`): MKL-packed
  float32, the checkpoint's own 4- and 8-bit codes dequantized exactly to float32
  (`exact_codes`, `llm.weights=int4-exact`), or 4-bit groups with bfloat16 activations
  (`llm.weights=int4`);
- in 16-bit dtypes each query row of a verification pass attends on its own
  (`_attend_by_row`), so a verified row is computed exactly as plain decoding computes
  it and speculative decoding stays token-for-token equal to it;
- with int4-exact weights a decoding pass runs all its decoder layers in one C++ call
  (`LeanStep`, kernels/lean_step.cpp: norms, products, rotary, the cache write and attention
  fused, every row computed alone), where torch's operations cost ~1,200 dispatches a step.

Its cache is `kv_cache.KVCache`, preallocated, rolled back by moving its length; a
`DynamicCache` passed in is filled as before (`update`), by torch's operations. RMSNorm
upcasts to float32 as transformers' does, so float64 outputs match `generate()` token for
token (tested).
Only plain Llama layers qualify (`supports`); anything else runs through transformers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from pipeline.llm.cuda_graph_step import MAX_GRAPHED_TOKENS, GraphBuffers, GraphedPass, graphs_apply
from pipeline.llm.exact_codes import ExactCodesLinear
from pipeline.llm.kv_cache import KVCache
from pipeline.llm.options import GRAPH_CACHE_TOKENS
from pipeline.llm.weight_kernels import (
    ROW_INVARIANT_ROWS,
    Int4Linear,
    Linear,
    PackedLinear,
    plain_linear,
    row_invariant_linear,
)

ROPE_TABLE_STEP = 1024  # positions added to the rotary table at a time
WEIGHT_FORMS = ("dense", "int4-exact", "int4-q8", "int4")  # llm.weights
# the forms run by the kernels of pipeline/llm/exact_codes.py (their threads: llm.kernel_threads)
CODED_FORMS = ("int4-exact", "int4-q8")
# A pass of up to this many tokens a row decodes or verifies; a longer one is a prompt's prefill,
# which runs batched attention and dense products (the fastest there, whatever the weights' form).
DECODE_MAX_TOKENS = 32
# A prompt of up to this many tokens is prefilled through the fused C++ pass, every row alone, as decoding
# computes it; a longer one through torch's batched pass over the dense weights. int4-q8: 1.3-2.2× faster
# from 40 to 300 tokens, its row-by-row attention catching up with its products past 512 (docs/benchmarks/
# history.md, 2026-12-05). int4-exact (float32 activations), 2026-12-07: on the idle machine 1.8× faster at
# 33 tokens, 1.2× at 48, even from 64 to 160 and 20% slower at 300; with the other core busy, as the asr
# keeps it while a caption or reply is written live, 1.2-2× faster at every length to 450 (a caption's
# prompt of 34-38 new tokens took 0.31-0.33 s dense against 0.08-0.13 s fused).
FUSED_PREFILL_TOKENS = {"int4-q8": 512, "int4-exact": 160}


@dataclass
class LeanOutput:
    """What a lean pass returns. `hidden` is the last decoder layer's output, before the final
    norm, at the positions whose logits are returned (EAGLE's feature, Li et al. 2024): a view
    of a tensor the pass computes anyway, so it costs nothing to hand out. The normed states
    the output matrix reads are `LeanLlama.normed(hidden)`."""

    logits: torch.Tensor  # [B, logits_to_keep (all positions when 0), V]
    cache: Any
    hidden: torch.Tensor | None = None  # [B, logits_to_keep (all positions when 0), hidden_size]


def supports(model: Any) -> bool:
    """A Llama model with default rotary embeddings, no biases, SiLU and full attention."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "llama":
        return False
    rope = getattr(config, "rope_parameters", None) or {}
    return (
        rope.get("rope_type", "default") == "default"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", "silu") == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
    )


class LeanLlama:
    """Calls like the transformers model for what the engine asks of it (ids, optional mask and
    positions, a cache, `logits_to_keep`), returning the logits and the grown cache."""

    def __init__(self, model: Any, packed: bool = True, weights: str = "dense",
                 row_invariant: bool | None = None, fused: bool = True, graphs: bool = True,
                 graph_tokens: int = GRAPH_CACHE_TOKENS) -> None:
        """`packed`: dense float32 weights are multiplied through MKL-packed copies where that
        kernel applies (`PackedLinear`). `weights="int4-exact"`: the weights as the 4- and 8-bit
        codes they were stored in, float32 arithmetic (`ExactCodesLinear`; a float32 model on
        a CPU). `weights="int4"`: the layers' weights as 4-bit groups (`Int4Linear`; a
        bfloat16 model on a CPU). `row_invariant`: a decoding pass computes
        each row exactly as a one-row pass would (`_attend_by_row`, row-invariant products);
        None: in 16-bit dtypes, where the rounding of another kernel path flips tokens. `fused`: with
        int4-exact weights, a decoding pass runs its decoder layers in one C++ call (`LeanStep`,
        kernels/lean_step.cpp) where the shapes allow; false: through torch's operations. `graphs`:
        on a CUDA device, decoding and verification passes of one reply are replayed as CUDA graphs
        where that applies (`cuda_graph_step.graphs_apply`; `llm.cuda_graphs`), over cache buffers of
        `graph_tokens` slots (`llm.cuda_graph_tokens`; a longer reply runs eagerly)."""
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a plain Llama model")
        if weights not in WEIGHT_FORMS:
            raise ValueError(f"unknown weight form {weights!r}: choose one of {', '.join(WEIGHT_FORMS)}")
        config = model.config
        self.config = config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.theta = float(config.rope_parameters["rope_theta"])
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [_fuse(layer) for layer in inner.layers]
        if row_invariant is None:
            row_invariant = self.embed.dtype in (torch.bfloat16, torch.float16)
        self.row_invariant = row_invariant
        self.linear = self._linear(packed, weights)
        self._cos = self._sin = self.embed.new_zeros(0, self.head_dim)
        self.fused = fused
        self.step = self._lean_step()
        # a longer pass than a decoding one that still runs fused: a prompt's (`FUSED_PREFILL_TOKENS`)
        self.fused_prefill_tokens = FUSED_PREFILL_TOKENS.get(getattr(self.linear, "form", ""), DECODE_MAX_TOKENS)
        self.graphs, self.graph_tokens = graphs, graph_tokens
        self.graphed, self.graph_buffers = self._graphed_pass_parts()
        # None, or a float64 [4] tensor to which the C++ pass adds its seconds by part (products,
        # attention, cache writes, norms/rotary/elementwise): bench/step_split.py reads it
        self.timings: torch.Tensor | None = None

    def _lean_step(self) -> Any:
        """The C++ decoding pass over these layers, where it applies: int4-exact weights (every layer
        matrix 4-bit records, float32 on a CPU), head_dim a multiple of 16 up to 128, heads · head_dim
        the hidden size. None elsewhere: the pass runs torch's operations."""
        linear = self.linear
        if not (self.fused and isinstance(linear, ExactCodesLinear) and self.head_dim % 16 == 0
                and self.head_dim <= 128 and self.heads * self.head_dim == self.embed.shape[1]):
            return None
        records = [[linear.coded[w.data_ptr()].records for w in weights]
                   for weights in zip(*((layer.qkv, layer.o, layer.gate_up, layer.down) for layer in self.layers),
                                      strict=True)]
        norms = [[layer.input_norm.contiguous() for layer in self.layers],
                 [layer.post_norm.contiguous() for layer in self.layers]]
        return linear.kernels.LeanStep(norms[0], records[0], records[1], norms[1], records[2], records[3],
                                       self.heads, self.kv_heads, self.head_dim, self.eps, linear.int8_activations)

    def _graphed_pass_parts(self) -> tuple[GraphedPass | None, GraphBuffers | None]:
        """This pass's decoding passes as CUDA graphs (`_graph_body`) and the cache buffers they are
        recorded over, where graphs apply; else None and None."""
        if not (self.graphs and graphs_apply(self.embed.device, self.row_invariant)):
            return None, None
        return GraphedPass(self._graph_body), GraphBuffers(self.graph_tokens)

    def _linear(self, packed: bool, weights: str) -> Linear:
        layer_weights = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if weights == "int4":
            Int4Linear.check(self.embed)
            return Int4Linear(layer_weights)  # the output projection stays dense (8-bit in the GGUF)
        if weights in CODED_FORMS:
            return ExactCodesLinear(layer_weights, self.lm_head, int8_activations=weights == "int4-q8")
        if packed and PackedLinear.applies(self.embed):
            return PackedLinear([*layer_weights, self.lm_head])
        return row_invariant_linear if self.row_invariant else plain_linear

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        use_cache: bool = True,  # accepted for the transformers call signature; the cache is always kept
        rows_alone: bool = False,
        visible: torch.Tensor | None = None,
    ) -> LeanOutput:
        """The logits of the last `logits_to_keep` positions (all when 0), the grown cache, and
        `hidden`: the last decoder layer's output at those positions, before the final norm.

        `rows_alone`: attend row by row even where the model does not (`row_invariant` false,
        float32), so that with row-invariant products (`exact_rows` > 1) every row of the pass is
        bit for bit what its own one-token pass computes; at most `DECODE_MAX_TOKENS` tokens.
        `visible`: bool [B or 1, new, past + new], the slots each new row attends to, in place of
        the causal mask (a token tree's: pipeline/llm/token_tree.py); with `position_ids`."""
        batch, new = input_ids.shape
        if cache is None:
            cache = KVCache(len(self.layers), batch, self.kv_heads, self.head_dim, self.embed.dtype,
                            self.embed.device, capacity=new)
        past = cache.get_seq_length()
        decoding = new <= DECODE_MAX_TOKENS
        if rows_alone and not decoding:
            raise ValueError(f"a rows_alone pass holds at most {DECODE_MAX_TOKENS} tokens, not {new}")
        if visible is not None and (attention_mask is not None or position_ids is None or not decoding):
            raise ValueError("a visible mask goes with position_ids, without attention_mask, in a decoding pass")
        fused = decoding or new <= self.fused_prefill_tokens  # a prompt too, where that pays
        if self.step is not None and fused and isinstance(cache, KVCache) and cache.batch == batch:
            return self._fused_pass(input_ids, cache, attention_mask, position_ids, logits_to_keep, visible)
        # graphed: one reply's step or verification (a chain or a tree); a one-token pass is its own row
        if (self.graphed is not None and self.graph_buffers is not None and batch == 1 and new <= MAX_GRAPHED_TOKENS
                and isinstance(cache, KVCache) and attention_mask is None
                and (position_ids is None) == (visible is None) and (new == 1 or not rows_alone)
                and self.graph_buffers.place(cache, past + new)):
            return self._graphed_pass(self.graphed, input_ids, cache, position_ids, visible, logits_to_keep)
        if position_ids is None:  # consecutive positions after the cache: a slice of the table
            self._grow_rotary_table(past + new)
            cos, sin = self._cos[None, None, past : past + new], self._sin[None, None, past : past + new]
        else:  # a batch's rows, each at its own positions
            self._grow_rotary_table(int(position_ids.max()) + 1)
            cos, sin = self._cos[position_ids][:, None], self._sin[position_ids][:, None]
        mask = _attention_mask(attention_mask, past, new, input_ids.device) if visible is None else visible[:, None]
        # attention row by row needs the mask; a one-token pass without padding (no mask) is one row already
        by_row = mask if (self.row_invariant or rows_alone) and decoding else None
        padded = by_row is not None and (by_row.shape[0] > 1 or visible is not None or not bool(by_row[0, 0, -1].all()))
        linear = self.linear if decoding else plain_linear

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.update(k, v, index)
            if by_row is not None:
                return _attend_by_row(q, keys, values, by_row, past, padded)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=self.heads != self.kv_heads)

        x = self._decoder_layers(F.embedding(input_ids, self.embed), cos, sin, attend, linear)
        keep = x[:, -logits_to_keep:] if logits_to_keep else x
        return LeanOutput(linear(self.normed(keep), self.lm_head), cache, keep)

    def _decoder_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Any,
                        linear: Linear) -> torch.Tensor:
        """The decoder layers over embeddings x [B, new, hidden], through torch's operations;
        `attend(layer index, q, k, v)` stores k and v in the cache and returns the attention's output."""
        batch, new, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, self.eps)
            qk, v = linear(h, layer.qkv).split((q_size + kv_size, kv_size), dim=-1)
            # q and k rotated in one call (the same elementwise arithmetic as one call each)
            qk = _rotate(qk.view(batch, new, self.heads + self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(batch, new, self.kv_heads, self.head_dim).transpose(1, 2)
            attended = attend(index, qk[:, : self.heads], qk[:, self.heads :], v)
            x = x + linear(attended.transpose(1, 2).reshape(batch, new, q_size), layer.o)
            h = _rms_norm(x, layer.post_norm, self.eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down)
        return x

    def _fused_pass(self, input_ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, logits_to_keep: int,
                    visible: torch.Tensor | None = None) -> LeanOutput:
        """A decoding pass whose decoder layers run in one C++ call (`self.step`), every row alone
        (so `rows_alone` holds by construction); the final norm and output matrix as in `__call__`."""
        batch, new = input_ids.shape
        past = cache.get_seq_length()
        self._grow_rotary_table(past + new if position_ids is None else int(position_ids.max()) + 1)
        mask = None if attention_mask is None else _attention_mask(attention_mask, past, new, input_ids.device)
        if visible is None and mask is not None:
            visible = mask[:, 0]
        if visible is not None:
            visible = visible.expand(batch, new, past + new)  # [B, new, past + new]
        start = cache.extend(new)
        x = F.embedding(input_ids, self.embed).view(batch * new, -1)
        x = self.step.forward(x, cache.keys, cache.values, start, self._cos, self._sin, position_ids, visible,
                              self.timings).view(batch, new, -1)
        keep = x[:, -logits_to_keep:] if logits_to_keep else x
        return LeanOutput(self.linear(self.normed(keep), self.lm_head), cache, keep)

    def _graphed_pass(self, graphed: GraphedPass, input_ids: torch.Tensor, cache: KVCache,
                      position_ids: torch.Tensor | None, visible: torch.Tensor | None,
                      logits_to_keep: int) -> LeanOutput:
        """A pass of one reply replayed as a CUDA graph recorded for its length and the cache's buffer."""
        new = input_ids.shape[1]
        self._grow_rotary_table(cache.capacity)  # every position a graph over this buffer can read
        start = cache.extend(new)
        positions = None if position_ids is None else position_ids[0].tolist()
        ancestors = None if visible is None else visible[0, :, start : start + new]
        logits, hidden = graphed(input_ids, start, positions, ancestors, logits_to_keep or new,
                                 cache.keys, cache.values, self._cos, self._sin)
        return LeanOutput(logits, cache, hidden)

    def record_graphs(self, tokens: int) -> int:
        """Record the graphs of chain passes of 1 to `tokens` tokens over one of the graphs' buffers
        now, so the first replies do not pay for them (vLLM records its graphs at start up too);
        returns how many were recorded. Tree passes and the other buffers record at first use."""
        if self.graphed is None:
            return 0
        before = self.graphed.recordings
        cache = KVCache(len(self.layers), 1, self.kv_heads, self.head_dim, self.embed.dtype, self.embed.device,
                        capacity=tokens)
        ids = torch.zeros((1, tokens), dtype=torch.int64, device=self.embed.device)
        for n in range(1, tokens + 1):
            cache.crop(0)
            self(ids[:, :n], cache=cache)
        return self.graphed.recordings - before

    def _graph_body(self, ids: torch.Tensor, where: torch.Tensor, ancestors: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `GraphedPass` records: the pass of `ids` [1, n] at positions `where[0]` written to
        cache slots `where[1]` (device tensors), with shapes that do not depend on them. The keys
        and values go to their slots by `index_copy_`; attention covers the cache's whole capacity,
        masked to the slots before the pass and, of the pass's own tokens, those `ancestors` [n, n]
        marks in the token's row (a chain's: itself and the tokens before it). Same arithmetic as
        `__call__`, but for the attention's masked reduction."""
        positions, slots = where[0], where[1]
        cos, sin = cos_table.index_select(0, positions)[None, None], sin_table.index_select(0, positions)[None, None]
        before = torch.arange(keys.shape[3], device=ids.device) < slots[:1]  # [capacity]: the cache before the pass
        seen = before.expand(ids.shape[1], -1).contiguous().index_copy_(1, slots, ancestors)[None, None]

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer_keys, layer_values = keys[index], values[index]  # [1, H_kv, capacity, D]
            layer_keys.index_copy_(2, slots, k)
            layer_values.index_copy_(2, slots, v)
            return F.scaled_dot_product_attention(q, layer_keys, layer_values, attn_mask=seen,
                                                  enable_gqa=self.heads != self.kv_heads)

        x = self._decoder_layers(F.embedding(ids, self.embed), cos, sin, attend, self.linear)
        return self.linear(self.normed(x), self.lm_head), x

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of `LeanOutput.hidden`: what the output matrix multiplies."""
        return _rms_norm(hidden, self.final_norm, self.eps)

    def truncated(self, layers: int) -> LeanLlama:
        """The first `layers` decoder layers, then the final norm and the output matrix, on the same
        weights and kernels: the early-exit drafter of a target that has a lean pass (the same
        network as `model.early_exit_model`, and like the target a pass whose rows can be exact)."""
        if not 0 < layers < len(self.layers):
            raise ValueError(f"early exit needs 1 to {len(self.layers) - 1} layers, not {layers}")
        shallow = copy.copy(self)
        shallow.layers = self.layers[:layers]
        shallow.step = shallow._lean_step()
        shallow.graphed, shallow.graph_buffers = shallow._graphed_pass_parts()  # its own graphs and buffers
        shallow.config = copy.deepcopy(self.config)  # its caches hold `layers` layers
        shallow.config.num_hidden_layers = layers
        if getattr(shallow.config, "layer_types", None):
            shallow.config.layer_types = shallow.config.layer_types[:layers]
        return shallow

    def unfused(self) -> LeanLlama:
        """This pass on the same weights and kernels through torch's operations, without the C++ step
        (what `llm.fused_step=false` runs; bench/step_split.py compares the two)."""
        plain = copy.copy(self)
        plain.fused, plain.step, plain.timings = False, None, None
        plain.graphed, plain.graph_buffers = plain._graphed_pass_parts()
        return plain

    def eager(self) -> LeanLlama:
        """This pass on the same weights with every step launched operation by operation, no CUDA
        graphs (bench spec's `specvox-none-eager` control; the graph tests' reference)."""
        plain = copy.copy(self)
        plain.graphed = plain.graph_buffers = None
        return plain

    @property
    def exact_rows(self) -> int:
        """The most tokens a `rows_alone` pass computes each exactly as a one-token pass would.

        That needs products whose rows do not depend on the rows beside them: the int4-exact
        kernel (by construction), torch's int4 kernel and `row_invariant_linear` in bfloat16
        (tests/e2e/test_weight_kernels.py). MKL's packed float32 product is not: which kernel path a
        pass of n rows takes depends on the CPU (one machine kept 23 rows apart, another only 3),
        so a float32 product, packed or plain, gives a token a pass of its own: 1; so does a GPU,
        where none of this was measured.
        """
        linear = self.linear
        # measured on CPUs only: elsewhere a token gets a pass of its own (exact by construction)
        sixteen_bit_cpu = self.embed.dtype in (torch.bfloat16, torch.float16) and self.embed.device.type == "cpu"
        exact = (isinstance(linear, Int4Linear) or (linear is row_invariant_linear and sixteen_bit_cpu)
                 or (isinstance(linear, ExactCodesLinear) and self.lm_head.data_ptr() in linear.coded))
        return ROW_INVARIANT_ROWS if exact else 1

    def _grow_rotary_table(self, needed: int) -> None:
        """The cos and sin table [positions, head_dim] covers positions below `needed`."""
        if needed > self._cos.shape[0]:
            size = -(-needed // ROPE_TABLE_STEP) * ROPE_TABLE_STEP
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64,
                                                          device=self.embed.device).float() / self.head_dim))
            # transformers computes the angles in float32 and casts cos/sin to the model's dtype
            angles = torch.arange(size, device=self.embed.device).float()[:, None] * inv_freq[None]
            angles = torch.cat((angles, angles), dim=-1)
            self._cos, self._sin = angles.cos().to(self.embed.dtype), angles.sin().to(self.embed.dtype)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _fuse(layer: Any) -> _Layer:
    """The layer's weights, q/k/v and gate/up each in one tensor whose slices the model now uses."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _fused_parameters([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = _fused_parameters([mlp.gate_proj, mlp.up_proj])
    return _Layer(layer.input_layernorm.weight, qkv, attn.o_proj.weight, layer.post_attention_layernorm.weight,
                  gate_up, mlp.down_proj.weight)


def _fused_parameters(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """One tensor holding the linears' weights, row blocks in order; each linear's weight
    becomes a view of its block (no second copy of the weights is kept)."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: computed in float32, cast back, then scaled."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), in transformers' rotate-half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attend_by_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   past: int, padded: bool) -> torch.Tensor:
    """Attention in which every query row attends alone, unmasked, to exactly the keys it may see.

    That is the call plain decoding makes for the same token (one row, the cache up to
    itself), so the row's result is the same to the bit. One batched, masked call over
    all rows takes another kernel path whose rounding differs; in bfloat16 that flips
    tokens (44 of 48 verification passes of the bundled target differed from their rows
    decoded one by one), which would break speculative decoding's equality with plain
    decoding. The row-by-row calls cost about 0.3 ms a layer for nine rows. `padded`: some
    row hides slots of the cache (a batch's padding), so its keys are gathered, not sliced.
    """
    batch, _, new, _ = q.shape
    gqa = q.shape[1] != keys.shape[1]
    rows = []
    for b in range(batch):
        for i in range(new):
            if padded:  # a batch row: gather the slots this query sees (its padding is hidden)
                seen = mask[min(b, mask.shape[0] - 1), 0, i]
                k, v = keys[b : b + 1, :, seen], values[b : b + 1, :, seen]
            else:  # the cache up to the query itself, as its own one-token pass sees it
                k, v = keys[b : b + 1, :, : past + i + 1], values[b : b + 1, :, : past + i + 1]
            rows.append(F.scaled_dot_product_attention(q[b : b + 1, :, i : i + 1], k, v, enable_gqa=gqa))
    return torch.cat(rows, dim=2).view(q.shape[1], batch, new, q.shape[3]).transpose(0, 1)  # (b, i) order


def _attention_mask(padding: torch.Tensor | None, past: int, new: int, device: torch.device) -> torch.Tensor | None:
    """Boolean [B or 1, 1, new, past + new] (True: may attend), None when a plain pass needs none.

    A new token at offset i sees the cache and the new tokens up to itself; `padding` [B,
    past + new] (1: a real token) hides a batch row's padding slots.
    """
    if new == 1 and padding is None:
        return None
    total = past + new
    causal = torch.ones(new, total, dtype=torch.bool, device=device).tril(diagonal=past)[None, None]
    if padding is None:
        return causal
    return causal & padding[:, None, None, :total].bool()
