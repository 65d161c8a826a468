"""Float32 products with the weights held as the 4- and 8-bit codes they were stored in.

The bundled target is a GGUF file: its layers are Q4_1 (w = d·q + m per group of 32, q in
0..15, d and m float16) and its output matrix Q8_0 (w = d·q, q in −127..127). Transformers
dequantizes them at load, so a float32 decoding step streams 540 MB of weights, which bounds
it at ~28 ms on this machine's memory whatever the kernel. Kept as codes they are 96 MB
(the layers at 5 bits a weight with their float16 scales and lows, the output matrix at 8.5),
and the kernel (`kernels/exact_codes.cpp`) dequantizes them in registers to the same float32
numbers: `pack_int4` and `pack_int8` only accept a matrix whose codes give back every
weight bit for bit, with d·q exact in float32 so the kernel's fused multiply-add rounds as
torch's two operations do. The arithmetic is float32 on the model's own weights
(`llm.weights=int4-exact`); only the order of each dot product's sums differs from torch's
kernels, as it does between any two float32 kernels. A step's products take ~12 ms for one
token and ~25 ms for nine, against ~36 and ~60 ms dense (docs/benchmarks.md).

Unlike `llm.weights=int4` (`weight_kernels.Int4Linear`: requantized weights, bfloat16
activations), nothing is rounded that the float32 model does not round, so outputs are
the float32 model's.

The kernel is C++ with AVX-512, compiled once per machine by torch's extension builder
(gcc and ninja; about a minute, then cached under torch's extensions directory).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.llm.weight_kernels import INT4_GROUP, plain_linear, quantize_int4

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("kernels") / "exact_codes.cpp"
LANES = 16  # output features per block of the kernel's layout: one AVX-512 register


@dataclass(frozen=True)
class CodedWeight:
    """A [out, in] float32 matrix as the kernel's records (see `kernels/exact_codes.cpp`):
    uint8 [out/16, in/32, record bytes], per block of 16 output features and group of 32
    inputs the float16 scales (and lows, for 4 bits) followed by the codes."""

    records: torch.Tensor
    bits: int  # 4 or 8

    @property
    def nbytes(self) -> int:
        return self.records.numel()


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on this machine, or None when it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the int4-exact kernel is written for x86-64 with AVX-512, not {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "the int4-exact kernel needs a CPU with AVX-512"
    return None


@functools.cache
def kernels():
    """The compiled kernel module: built on first use, then loaded from torch's cache."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    from torch.utils import cpp_extension

    source = KERNEL_SOURCE.read_bytes()
    # -march=native builds for this CPU, so the cached build is keyed by the source and the CPU's flags
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split("flags", 1)[-1].split("\n", 1)[0] if cpuinfo.exists() else platform.processor()
    name = "specvox_exact_codes_" + hashlib.sha256(source + flags.encode()).hexdigest()[:12]
    log.info("loading the int4-exact kernel (compiled on first use on this machine: about a minute)")
    return cpp_extension.load(name, [str(KERNEL_SOURCE)], extra_cflags=["-O3", "-march=native"], verbose=False)


def _by_blocks(per_feature: torch.Tensor) -> torch.Tensor:
    """[out, k] → [out/16, k, 16]: each block's 16 output features side by side."""
    out, k = per_feature.shape
    return per_feature.reshape(out // LANES, LANES, k).transpose(1, 2).contiguous()


def _halves(per_group: torch.Tensor) -> torch.Tensor:
    """[out, groups] float32 → [out/16, groups, 32] bytes: each block's 16 values as float16."""
    return _by_blocks(per_group.half()).view(torch.uint8)


def _exact(q: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether every scale is a float16 value and every q·scale is exact in float32 (then a
    fused multiply-add rounds like a multiply and an add)."""
    wide = q.double() * scale.double()
    return torch.equal(scale.half().float(), scale) and torch.equal(wide.float().double(), wide)


def _coded_shape_ok(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[0] % LANES == 0 and weight.shape[1] % INT4_GROUP == 0)


def pack_int4(weight: torch.Tensor) -> CodedWeight | None:
    """The matrix as 4-bit codes with a scale and a low per group of 32 (Q4_1's grid), or None
    when the codes do not give back every weight bit for bit."""
    if not _coded_shape_ok(weight):
        return None
    q, scale, low = quantize_int4(weight)
    out, width = q.shape
    groups = width // INT4_GROUP
    grouped = q.reshape(out, groups, INT4_GROUP).float()
    if not (_exact(grouped, scale[..., None]) and torch.equal(low.half().float(), low)
            and torch.equal((grouped * scale[..., None] + low[..., None]).reshape(out, width), weight)):
        return None
    pairs = _by_blocks(q.to(torch.uint8)).reshape(out // LANES, width // 2, 2, LANES)
    codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out // LANES, groups, INT4_GROUP // 2 * LANES)
    return CodedWeight(torch.cat((_halves(scale), _halves(low), codes), dim=-1).contiguous(), bits=4)


def pack_int8(weight: torch.Tensor) -> CodedWeight | None:
    """The matrix as 8-bit codes with a scale per group of 32 (Q8_0's grid: the group's largest
    magnitude is code ±127), or None when the codes do not give back every weight bit for bit."""
    if not _coded_shape_ok(weight):
        return None
    out, width = weight.shape
    groups = weight.reshape(out, width // INT4_GROUP, INT4_GROUP)
    scale = groups.abs().amax(-1) / 127
    q = (groups / scale[..., None].clamp(min=torch.finfo(torch.float32).tiny)).round()
    if not (_exact(q, scale[..., None]) and torch.equal(q * scale[..., None], groups)):
        return None
    codes = _by_blocks(q.reshape(out, width).to(torch.int8)).view(torch.uint8)
    codes = codes.reshape(out // LANES, width // INT4_GROUP, INT4_GROUP * LANES)
    return CodedWeight(torch.cat((_halves(scale), codes), dim=-1).contiguous(), bits=8)


class ExactCodesLinear:
    """x @ W.T for float32 x, with the layers' weights as 4-bit codes and the output matrix as
    8-bit codes (`llm.weights=int4-exact`). A weight with no coded form goes through `F.linear`.

    Raises ValueError, naming how many, when the layers' weights are not exactly 4-bit codes:
    the mode exists for quantized checkpoints (a Q4_1 GGUF), where they are.
    """

    def __init__(self, layer_weights: Sequence[torch.Tensor], output_weight: torch.Tensor | None = None) -> None:
        reason = unavailable_reason()
        if reason:
            raise ValueError(f"llm.weights=int4-exact: {reason}; use llm.weights=dense")
        self.kernels = kernels()
        self.coded: dict[int, CodedWeight] = {}
        misses = 0
        for weight in layer_weights:
            packed = pack_int4(weight)
            misses += packed is None
            if packed is not None:
                self.coded[weight.data_ptr()] = packed
        if misses:
            raise ValueError(f"llm.weights=int4-exact needs layer weights that are exactly 4-bit codes in groups of 32 "
                             f"(a Q4_1 GGUF target), in float32 on a CPU; {misses} of {len(layer_weights)} are not: "
                             "use llm.weights=dense, or int4 to requantize")
        if output_weight is not None:
            packed = pack_int8(output_weight)
            if packed is not None:
                self.coded[output_weight.data_ptr()] = packed
            else:
                log.info("int4-exact: the output matrix is not 8-bit codes; it stays dense")

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.coded.values())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        coded = self.coded.get(weight.data_ptr())
        if coded is None:
            return plain_linear(x, weight)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        product = self.kernels.int4_linear if coded.bits == 4 else self.kernels.int8_linear
        out = product(rows, coded.records)
        return out.view(*x.shape[:-1], out.shape[-1])
