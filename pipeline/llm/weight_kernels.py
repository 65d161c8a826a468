"""How the lean pass multiplies by a weight matrix: x @ W.T, with W kept in the form its kernel wants.

Chosen per model at load (`LeanLlama`, which runs a long prompt's prefill through
`plain_linear` whatever the form: there the dense product is the fastest):

- `plain_linear`: `F.linear` on the weights as loaded (any device and dtype);
- `row_invariant_linear`: `F.linear` in calls of at most 16 rows (16-bit dtypes);
- `PackedLinear`: MKL's packed sgemm on float32 copies packed once (CPU, float32);
- `Int4Linear`: 4-bit weights in groups of 32 with a scale and a zero each, through torch's
  CPU int4 kernel with bfloat16 activations (`llm.weights=int4`).

`row_invariant_linear` and `Int4Linear` are what the 16-bit configurations need: a row's
result does not depend on how many rows share the call, so a verification pass reproduces
plain decoding bit for bit (`tests/e2e/test_weight_kernels.py`). Torch's float32 product is
not row-invariant (one row takes a matrix-vector path, two or more a matrix-matrix one),
nor is MKL's packed one on every shape; in float32 that is rounding which has not
changed a chosen token in any test or benchmark run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

ROW_INVARIANT_ROWS = 16  # oneDNN's bfloat16 product keeps rows apart up to 17 rows here; 33 rows differ
PACKED_FOR_ROWS = 9  # MKL packs for a row count; the packed weights serve any (a verify pass is 1-9 rows)
INT4_GROUP = 32  # input weights per scale and zero: the block of GGUF's Q4_1, the bundled target's format

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear` in calls of at most `ROW_INVARIANT_ROWS` rows, so a row's result is the same
    in a batch's verification pass (up to 8 × 9 rows) as in its own one-token step."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= ROW_INVARIANT_ROWS:
        return F.linear(x, weight)
    out = torch.cat([F.linear(chunk, weight) for chunk in rows.split(ROW_INVARIANT_ROWS)])
    return out.view(*x.shape[:-1], weight.shape[0])


class PackedLinear:
    """x @ W.T through MKL's packed sgemm (float32 on a CPU with MKL), W packed once at load.

    For the few rows of a verification pass (3 to 32 tokens) torch's float32 matrix
    product leaves the memory-bound path it takes for one or two rows: on 2 cores the
    30 layers' products cost 27 ms for one token and 68 ms for nine. MKL's packed kernel
    (what PyTorch's inductor uses for frozen CPU linears) keeps one token at 27 ms and does
    nine in 42 ms, so a verified token costs less than half as much (docs/benchmarks/history.md).
    The packed copies add about 1.3 times the weights' size in memory (+0.7 GB for the
    bundled target; `llm.pack_weights=false` goes without). Results agree with F.linear to
    float32 rounding (the summation order differs), not bit for bit.
    """

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        self.packed = {w.data_ptr(): torch.ops.mkl._mkl_reorder_linear_weight(w, PACKED_FOR_ROWS) for w in weights}

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(rows, self.packed[weight.data_ptr()], weight, None, rows.shape[0])
        return out.view(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class Int4Weight:
    """A [out, in] matrix as 4-bit codes q in groups of `INT4_GROUP` along `in`: w = scale·q + low."""

    packed: torch.Tensor  # the kernel's layout of q
    scales_zeros: torch.Tensor  # [in / group, out, 2] bfloat16: scale, and the kernel's zero low + 8·scale
    out_features: int


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit codes per group: (q [out, in] int32, scale, low [out, groups]).

    The group's minimum maps to code 0 and its maximum to 15, as llama.cpp's Q4_1 quantizer
    does, so weights that were Q4_1 (the bundled GGUF target, dequantized at load) come
    back on their own grid.
    """
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP:
        raise ValueError(f"int4 weights need an input size divisible by {INT4_GROUP}, not {in_features}")
    groups = weight.detach().float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.reshape(out_features, in_features), scale, low


def pack_int4(weight: torch.Tensor) -> Int4Weight:
    q, scale, low = quantize_int4(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel computes (q - 8)·scale + zero, so its zero is low + 8·scale
    scales_zeros = torch.stack((scale, low + 8 * scale), dim=-1).transpose(0, 1).contiguous()
    return Int4Weight(packed, scales_zeros.to(torch.bfloat16), weight.shape[0])


class Int4Linear:
    """x @ W.T with W in 4-bit groups (`pack_int4`), x in bfloat16, on a CPU (`llm.weights=int4`).

    A float32 decoding step of the bundled target reads 540 MB of weights, which bounds
    it at ~28 ms on this machine's memory; the same weights as 4-bit codes are 70 MB and
    the 30 layers' products take ~9 ms for one token. The bundled target is a Q4_1 GGUF,
    so its codes are the file's own; only the per-group scale and zero are rounded to
    bfloat16. Weights without a packed form (the output projection, which the GGUF
    stores in 8 bits) go through `F.linear` in bfloat16. For a long prompt the kernel is
    2-3 times slower than the dense bfloat16 product (75 tokens: 141 against 69 ms), so
    `LeanLlama` prefills those through the model's dense weights.
    """

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        self.packed = {w.data_ptr(): pack_int4(w) for w in weights}

    @staticmethod
    def check(weight: torch.Tensor) -> None:
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            raise ValueError(f"the int4 kernel needs a bfloat16 model on a CPU, not {weight.dtype} on {weight.device}")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        int4 = self.packed.get(weight.data_ptr())
        if int4 is None:
            return row_invariant_linear(x, weight)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, int4.packed, INT4_GROUP, int4.scales_zeros)
        return out.view(*x.shape[:-1], int4.out_features)
