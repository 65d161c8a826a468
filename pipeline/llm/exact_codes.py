"""Float32 products with the weights held as the 4- and 8-bit codes they were stored in.

The bundled target is a GGUF file: its layers are Q4_1 (w = d·q + m per group of 32, q in
0..15, d and m float16) and its output matrix Q8_0 (w = d·q, q in −127..127). Transformers
dequantizes them at load, so a float32 decoding step streams 540 MB of weights, which bounds
it at ~28 ms on this machine's memory whatever the kernel. Kept as codes they are 96 MB
(the layers at 5 bits a weight with their float16 scales and lows, the output matrix at 8.5),
and the kernel (`kernels/exact_codes.cpp`, its products in `kernels/codes.h`) dequantizes
them in registers to the same float32 numbers: `pack_int4` and `pack_int8` only accept a
matrix whose codes give back every weight bit for bit, with d·q exact in float32 so the
kernel's fused multiply-add rounds as torch's two operations do. The arithmetic is float32 on the model's own weights
(`llm.weights=int4-exact`); only the order of each dot product's sums differs from torch's
kernels, as it does between any two float32 kernels. A step's products take ~12 ms for one
token and ~25 ms for nine, against ~36 and ~60 ms dense, on an AVX-512 host (docs/benchmarks/history.md,
which has the AVX2 figures too).

Unlike `llm.weights=int4` (`weight_kernels.Int4Linear`: requantized weights, bfloat16
activations), nothing is rounded that the float32 model does not round, so outputs are
the float32 model's.

`llm.weights=int4-q8` runs the same codes on activations quantized to 8 bits per group of 32
(GGUF's Q8_0, row by row) with integer dot products (`kernels/codes.h`, "8-bit activations"), as
llama.cpp does: a third of the float32 path's instructions a weight, so a one-token step's
products take about a third of the time and a verified row about half; outputs are the form's
own, not float32's, and each row is still computed alone (speculative decoding equals plain
decoding in it). Its prompts are prefilled through the fused pass too (`lean_llama.FUSED_PREFILL_TOKENS`).

The kernels' loops run on `llm.kernel_threads` threads (`kernels/pool.h`: helpers that the calling
thread never waits on to start, off by themselves where the cores are taken; the bits do not
depend on the count).

The kernel is C++ written once on a 16-lane vector (`kernels/simd16.h`) that is one AVX-512
register, or two AVX2 registers on a CPU with AVX2, FMA and F16C but no AVX-512; its summation
orders are fixed per instruction set, so results are reproducible on one machine (and each row
is computed alone on either), not necessarily bit for bit between an AVX2 and an AVX-512 host.
It is compiled once per machine by torch's extension builder
(gcc and ninja; about a minute, then cached under torch's extensions directory:
`$TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions/py311_cpu`). `make install` builds it
(`python -m pipeline.llm.exact_codes --build`), so the first load finds it in that cache.

`llm.weights=auto` (the default) runs this form where it applies: `checkpoint_reason` says
whether a checkpoint is stored as the codes the kernel reads, `unavailable_reason` whether
this machine can run the kernel (`pipeline.llm.model.auto_weights` decides).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import logging
import mmap
import os
import platform
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.llm.weight_kernels import INT4_GROUP, plain_linear, quantize_int4

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
KERNEL_SOURCE = KERNELS / "exact_codes.cpp"
# one extension: the products (exact_codes.cpp), the whole decoding pass (lean_step.cpp), what they share
# (codes.h; simd16.h: the 16-lane vector, one AVX-512 or two AVX2 registers; pool.h: the helper threads)
KERNEL_FILES = (KERNEL_SOURCE, KERNELS / "lean_step.cpp", KERNELS / "codes.h", KERNELS / "simd16.h",
                KERNELS / "pool.h")
# Built without -fopenmp: the kernels' loops share their work with pool.h's helper threads
# (`llm.kernel_threads`), which the caller never waits on to start. OpenMP's regions did: on a
# machine whose 2 cores other processes share, each of a step's ~150 regions waited for its second
# thread to be scheduled (2026-12-02 under load ~4: 396 ms a one-token step on 2 threads against
# 28 ms on one; docs/benchmarks/history.md, "Lean step and llama.cpp").
KERNEL_FLAGS = ("-O3", "-march=native")
LANES = 16  # output features per block of the kernel's layout: one AVX-512 register, or two AVX2 ones
# torch's CPU capability → the instruction set the kernel is compiled for (simd16.h): its vector is
# one zmm register with AVX-512, two ymm registers with AVX2 (torch reports AVX2 with FMA too).
KERNEL_ISAS = {"AVX512": "avx512", "AVX2": "avx2"}


@dataclass(frozen=True)
class CodedWeight:
    """A [out, in] float32 matrix as the kernel's records (see `kernels/exact_codes.cpp`):
    uint8 [out/16, in/32, record bytes], per block of 16 output features and group of 32
    inputs the float16 scales (and lows, for 4 bits) followed by the codes."""

    records: torch.Tensor
    bits: int  # 4 or 8
    # the codes in dot-product order, for products on 8-bit activations (llm.weights=int4-q8)
    int8_activations: bool = False

    @property
    def nbytes(self) -> int:
        return self.records.numel()


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    return set(cpuinfo.read_text().split("flags", 1)[-1].split("\n", 1)[0].lstrip(" \t:").split())


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on this machine, or None when it can: x86-64 with AVX-512, or
    with AVX2, FMA and F16C (torch's CPU capability "AVX512" or "AVX2")."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the int4-exact kernel is written for x86-64 with AVX2 or AVX-512, not {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in KERNEL_ISAS:
        return f"the int4-exact kernel needs a CPU with AVX2 (and FMA) or AVX-512; torch reports {capability}"
    flags = _cpu_flags()
    if capability == "AVX2" and flags and "f16c" not in flags:
        return "the int4-exact kernel needs F16C beside AVX2 (float16 scales); this CPU has none"
    return None


# GGUF tensor types (ggml_type) the kernel reads as they are stored.
GGML_Q4_1, GGML_Q8_0 = 3, 8
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
                   11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
# The matrices of a Llama block in GGUF's names; `LeanLlama` runs all of them through the kernel.
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# GGUF metadata value types: byte sizes of the scalars (8 is a string, 9 an array).
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_tensor_types(path: str | Path) -> dict[str, int]:
    """Each tensor's ggml type in a GGUF file (version 2 or 3), read from the header alone.

    gguf's `GGUFReader` maps every tensor and metadata array (~1.6 s for the bundled file);
    this reads the tensor table only (a few milliseconds). ValueError on a file that is not GGUF.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, tensors, kvs = struct.unpack_from("<IQQ", data, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        at = 24

        def string() -> str:
            nonlocal at
            (length,) = struct.unpack_from("<Q", data, at)
            at += 8 + length
            return bytes(data[at - length : at]).decode("utf-8", "replace")

        def skip_value(kind: int) -> None:
            nonlocal at
            if kind == _GGUF_STRING:
                string()
            elif kind == _GGUF_ARRAY:
                item, count = struct.unpack_from("<IQ", data, at)
                at += 12
                if item in _GGUF_SCALAR_BYTES:
                    at += count * _GGUF_SCALAR_BYTES[item]
                else:
                    for _ in range(count):
                        skip_value(item)
            elif kind in _GGUF_SCALAR_BYTES:
                at += _GGUF_SCALAR_BYTES[kind]
            else:
                raise ValueError(f"{path}: unknown GGUF metadata type {kind}")

        for _ in range(kvs):
            string()
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4
            skip_value(kind)
        types = {}
        for _ in range(tensors):
            name = string()
            (dims,) = struct.unpack_from("<I", data, at)
            at += 4 + 8 * dims
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4 + 8  # the type, then the data offset
            types[name] = kind
        return types


def checkpoint_reason(gguf_path: str | Path | None) -> str | None:
    """Why a checkpoint's weights are not the codes the kernel reads (None: every layer matrix
    is stored as Q4_1). Only a GGUF file can be: a folder or hub id stores float weights. The
    output matrix may be Q8_0 (coded too) or anything else (it stays dense)."""
    if gguf_path is None:
        return "the checkpoint is not a GGUF file of Q4_1 codes"
    try:
        types = gguf_tensor_types(gguf_path)
    except (OSError, ValueError, struct.error) as e:
        return f"the checkpoint's tensor types could not be read ({e})"
    layers = {n: t for n, t in types.items() if n.startswith("blk.") and n.split(".")[-2] in LAYER_MATRICES}
    if not layers:
        return "the checkpoint has no Llama layer matrices (blk.N.attn_q ...)"
    other = sorted({GGML_TYPE_NAMES.get(t, f"type {t}") for t in layers.values() if t != GGML_Q4_1})
    if other:
        return f"the checkpoint's layer weights are stored as {', '.join(other)}, not Q4_1"
    return None


def kernel_name() -> str:
    """The extension's name: the instruction set it is compiled for, then a hash of the kernel's
    sources, its compiler flags, this CPU's flags (it is built with -march=native, so a build for
    another CPU, AVX2 or AVX-512, is never loaded here) and the build's environment: where the
    sources and this torch are, and torch's version. Two environments sharing torch's extensions
    cache (the Coqui backend's has torch 2.9, against 2.13 here) or two checkouts then build apart,
    instead of rebuilding over each other (half a minute each load) and loading a library built
    against the other torch. E.g. `specvox_exact_codes_avx2_0123456789ab`."""
    source = b"".join(path.read_bytes() for path in KERNEL_FILES) + " ".join(KERNEL_FLAGS).encode()
    flags = " ".join(sorted(_cpu_flags())) or platform.processor()
    environment = f"{KERNELS.resolve()} {Path(torch.__file__).resolve().parent} {torch.__version__} {sys.version}"
    isa = KERNEL_ISAS.get(torch.backends.cpu.get_cpu_capability(), "unsupported")
    digest = hashlib.sha256(source + flags.encode() + environment.encode()).hexdigest()[:12]
    return f"specvox_exact_codes_{isa}_{digest}"


@functools.cache
def kernels():
    """The compiled kernel module: built on first use, then loaded from torch's cache."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    log.info("loading the int4-exact kernel (compiled on first use on this machine: about a minute)")
    return build_kernels(kernel_name())


def build_kernels(name: str, extra_flags: Sequence[str] = ()):
    """The kernel module built as `name` with `KERNEL_FLAGS` and `extra_flags` (tests build it for a
    lower instruction set too), or loaded from torch's cache where that build is there."""
    from torch.utils import cpp_extension

    sources = [str(path) for path in KERNEL_FILES if path.suffix == ".cpp"]
    # torch's own build lock is a file that a killed build leaves behind, and every later load
    # then waits on it forever. Builds of ours take an flock first (the kernel drops it when its
    # holder dies), so whoever holds it knows a `lock` file left there is stale.
    build = Path(cpp_extension._get_build_directory(name, verbose=False))
    with open(build.parent / f"{name}.build-lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that did not finish", stale)
            stale.unlink(missing_ok=True)
        with _this_environments_ninja():
            return cpp_extension.load(name, sources, extra_cflags=[*KERNEL_FLAGS, *extra_flags],
                                      extra_include_paths=[str(KERNELS)], build_directory=str(build), verbose=False)


@contextlib.contextmanager
def _this_environments_ninja() -> Iterator[None]:
    """torch runs the `ninja` first on PATH: the one our dependencies install beside this
    interpreter in an activated environment, often the system's (1.11 here, against 1.13) when
    the environment's python is run by path (`make test`, a service started by a supervisor).
    Two ninja versions hash a build's commands differently, so each took the other's build for
    stale and compiled again (half a minute at each alternation). The build runs with this
    interpreter's folder first on PATH where a ninja is there."""
    scripts = Path(sys.executable).parent
    if not (scripts / "ninja").exists():
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((str(scripts), path)) if path else str(scripts)
    try:
        yield
    finally:
        os.environ["PATH"] = path


# llm.kernel_threads=0 takes one thread per core, up to this many: a one-token step's smaller products
# are 36 blocks of 16 features (the bundled target's), in chunks of one block past 4 threads.
MAX_KERNEL_THREADS = 4


def set_kernel_threads(requested: int) -> int:
    """Put the kernels' loops on `requested` threads, the caller's included (0: one per core this
    process may run on, at most `MAX_KERNEL_THREADS`); the count now in force. The helpers are one
    set a process (`kernels/pool.h`), shared by every model it loads."""
    if requested < 0:
        raise ValueError(f"llm.kernel_threads must be 0 (one per core) or more, not {requested}")
    threads = requested or min(MAX_KERNEL_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                               else os.cpu_count() or 1)
    return int(kernels().set_threads(threads))


def kernel_threads() -> int:
    """The threads the kernels' loops run on now (1 where the kernel is not loaded)."""
    return int(kernels().threads()) if kernels.cache_info().currsize else 1


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


def pack_int4(weight: torch.Tensor, int8_activations: bool = False) -> CodedWeight | None:
    """The matrix as 4-bit codes with a scale and a low per group of 32 (Q4_1's grid), or None
    when the codes do not give back every weight bit for bit. `int8_activations`: the codes in the
    order the products on 8-bit activations read them (`kernels/codes.h`, `Int4DotCodes`)."""
    if not _coded_shape_ok(weight):
        return None
    q, scale, low = quantize_int4(weight)
    out, width = q.shape
    groups = width // INT4_GROUP
    grouped = q.reshape(out, groups, INT4_GROUP).float()
    if not (_exact(grouped, scale[..., None]) and torch.equal(low.half().float(), low)
            and torch.equal((grouped * scale[..., None] + low[..., None]).reshape(out, width), weight)):
        return None
    q = q.to(torch.uint8)
    if int8_activations:
        # [block, t, group, j, half, k] -> [block, group, j, half, t, k]: byte 4t+k of vector j holds
        # input 8j+k in its low 4 bits and input 8j+4+k in its high 4
        split = q.reshape(out // LANES, LANES, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        codes = (split[:, :, :, 0] | (split[:, :, :, 1] << 4)).reshape(out // LANES, groups, INT4_GROUP // 2 * LANES)
    else:
        pairs = _by_blocks(q).reshape(out // LANES, width // 2, 2, LANES)
        codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out // LANES, groups, INT4_GROUP // 2 * LANES)
    return CodedWeight(torch.cat((_halves(scale), _halves(low), codes), dim=-1).contiguous(), bits=4,
                       int8_activations=int8_activations)


def pack_int8(weight: torch.Tensor, int8_activations: bool = False) -> CodedWeight | None:
    """The matrix as 8-bit codes with a scale per group of 32 (Q8_0's grid: the group's largest
    magnitude is code ±127), or None when the codes do not give back every weight bit for bit.
    `int8_activations`: the codes plus 128, in the order the products on 8-bit activations read
    them (`kernels/codes.h`, `Int8DotCodes`)."""
    if not _coded_shape_ok(weight):
        return None
    q, scale = q8_0_codes(weight)
    grouped = q.reshape(*scale.shape, INT4_GROUP)
    if not (_exact(grouped, scale[..., None]) and torch.equal(grouped * scale[..., None],
                                                                weight.reshape(*scale.shape, INT4_GROUP))):
        return None
    return int8_records(q, scale, int8_activations)


def int8_records(q: torch.Tensor, scale: torch.Tensor, int8_activations: bool = False) -> CodedWeight:
    """The kernel's records of a matrix given as its 8-bit codes q [out, in] (whole numbers in
    −127..127) and a float16-valued scale per group of 32 [out, in/32]: the matrix q·scale."""
    out, width = q.shape
    if int8_activations:
        # [block, t, group, j, k] -> [block, group, j, t, k]: byte 4t+k of vector j holds input 4j+k
        shifted = (q.to(torch.int16) + 128).to(torch.uint8)
        codes = shifted.reshape(out // LANES, LANES, width // INT4_GROUP, 8, 4).permute(0, 2, 3, 1, 4)
    else:
        codes = _by_blocks(q.to(torch.int8)).view(torch.uint8)
    codes = codes.reshape(out // LANES, width // INT4_GROUP, INT4_GROUP * LANES)
    return CodedWeight(torch.cat((_halves(scale), codes), dim=-1).contiguous(), bits=8,
                       int8_activations=int8_activations)


def q8_0_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [out, in] rounded to GGUF's Q8_0 grid: (codes [out, in], float16-valued
    scales [out, in/32]), the scale of a group its largest magnitude / 127 in float16, the codes
    the nearest multiples of it. For weights that were not stored as codes (a draft head's)."""
    out, width = weight.shape
    groups = weight.float().reshape(out, width // INT4_GROUP, INT4_GROUP)
    scale = (groups.abs().amax(-1) / 127).half().float()
    q = (groups / scale[..., None].clamp(min=torch.finfo(torch.float32).tiny)).round().clamp(-127, 127)
    return q.reshape(out, width), scale


class ExactCodesLinear:
    """x @ W.T for float32 x, with the layers' weights as 4-bit codes and the output matrix as
    8-bit codes (`llm.weights=int4-exact`). A weight with no coded form goes through `F.linear`.
    `int8_activations`: the products quantize x to 8 bits per group of 32 first and sum integer
    products, as llama.cpp does (`llm.weights=int4-q8`; `kernels/codes.h`): about a third of the
    float32 path's instructions a weight, outputs no longer float32's but the same for a row
    whatever rows are beside it.

    Raises ValueError, naming how many, when the layers' weights are not exactly 4-bit codes:
    the mode exists for quantized checkpoints (a Q4_1 GGUF), where they are.
    """

    def __init__(self, layer_weights: Sequence[torch.Tensor], output_weight: torch.Tensor | None = None,
                 int8_activations: bool = False) -> None:
        self.form = "int4-q8" if int8_activations else "int4-exact"
        self.int8_activations = int8_activations
        reason = unavailable_reason()
        if reason:
            raise ValueError(f"llm.weights={self.form}: {reason}; use llm.weights=dense")
        self.kernels = kernels()
        self.coded: dict[int, CodedWeight] = {}
        misses = 0
        for weight in layer_weights:
            packed = pack_int4(weight, int8_activations)
            misses += packed is None
            if packed is not None:
                self.coded[weight.data_ptr()] = packed
        if misses:
            raise ValueError(f"llm.weights={self.form} needs layer weights that are exactly 4-bit codes in groups "
                             f"of 32 (a Q4_1 GGUF target), in float32 on a CPU; {misses} of {len(layer_weights)} "
                             "are not: use llm.weights=dense, or int4 to requantize")
        if output_weight is not None:
            packed = pack_int8(output_weight, int8_activations)
            if packed is not None:
                self.coded[output_weight.data_ptr()] = packed
            else:
                log.info("%s: the output matrix is not 8-bit codes; it stays dense", self.form)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.coded.values())

    def _product(self, coded: CodedWeight):
        if coded.int8_activations:
            return self.kernels.int4_q8_linear if coded.bits == 4 else self.kernels.int8_q8_linear
        return self.kernels.int4_linear if coded.bits == 4 else self.kernels.int8_linear

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        coded = self.coded.get(weight.data_ptr())
        if coded is None:
            return plain_linear(x, weight)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = self._product(coded)(rows, coded.records)
        return out.view(*x.shape[:-1], out.shape[-1])


def build() -> str:
    """Build the kernel for this machine (or find it in torch's cache); what was done, in a line.

    `make install` runs this (`python -m pipeline.llm.exact_codes --build`), so that the first
    load with `llm.weights=auto` or `int4-exact` does not spend a minute compiling.
    """
    reason = unavailable_reason()
    if reason:
        return f"int4-exact kernel not built: {reason}; llm.weights=auto runs dense weights here"
    started = time.perf_counter()
    module = kernels()
    return f"int4-exact kernel ready ({module.isa}) in {time.perf_counter() - started:.1f} s: {module.__file__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.llm.exact_codes",
                                     description="the int4-exact kernel (llm.weights=auto or int4-exact)")
    parser.add_argument("--build", action="store_true",
                        help="compile it for this CPU into torch's extensions cache "
                             "(nothing to do without AVX2 or AVX-512)")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 2
    try:
        print(build(), flush=True)
    except Exception as e:  # noqa: BLE001 - an install step: say why, and let llm.weights=auto fall back
        print(f"int4-exact kernel not built ({type(e).__name__}: {e}); llm.weights=auto runs dense weights "
              "until it builds (it is tried again at load)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
