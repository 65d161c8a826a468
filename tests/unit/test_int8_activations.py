"""`llm.weights=int4-q8`: the GGUF's codes on activations quantized to 8 bits per group of 32
(kernels/codes.h). The activations are GGUF's Q8_0 of each row, the products are the exact integer
sums scaled group by group, each row is computed alone (on any number of rows and threads), and an
instruction set without VNNI or without AVX-512 computes the same bits. That speculative decoding
in this form equals its own plain decoding is tests/e2e/test_lossless.py's (every weight form).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from pipeline.llm import exact_codes
from pipeline.llm.exact_codes import ExactCodesLinear, unavailable_reason
from pipeline.llm.weight_kernels import quantize_int4
from tests.e2e.test_exact_codes import GROUP, q4_1_matrix, q8_0_matrix

needs_kernel = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def coded_q8():
    torch.manual_seed(1)
    layer, output = q4_1_matrix(96, 1536), q8_0_matrix(160, 576)
    return ExactCodesLinear([layer], output, int8_activations=True), layer, output


def q8_0_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x as GGUF's Q8_0 quantizes it, in torch: per group of 32, da = max|x| / 127 and
    codes round(x · 127 / max|x|) (ties to even); the codes, the scales and each group's code sum."""
    groups = x.reshape(x.shape[0], -1, GROUP)
    top = groups.abs().amax(-1)
    # 127 / max|x| rounded once (torch's scalar / tensor multiplies by a reciprocal: not always the same float)
    inverse = torch.where(top > 0, torch.full_like(top, 127) / top, torch.zeros_like(top))
    codes = torch.round(groups * inverse[..., None]).to(torch.int8)
    return codes.reshape(x.shape), top / 127, codes.int().sum(-1)


def q8_reference(x: torch.Tensor, weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The product on 8-bit activations in float64 from exact integer sums: per group,
    d·da·Σ q·qa (+ m·da·Σ qa for 4-bit codes with a low); and the sum of the terms' magnitudes."""
    codes, scale, sums = q8_0_rows(x)
    rows = codes.reshape(x.shape[0], -1, GROUP).long()
    if bits == 4:
        q, d, m = quantize_int4(weight)
        q = q.reshape(weight.shape[0], -1, GROUP).long()
        whole = torch.einsum("rgk,ogk->rog", rows, q).double()
        scaled, low = whole * d.double()[None], m.double()[None] * sums.double()[:, None]
        terms = (scaled + low) * scale.double()[:, None]
        # the two parts are rounded apart (and cancel): each's magnitude bounds the rounding
        return terms.sum(-1), ((scaled.abs() + low.abs()) * scale.double()[:, None]).sum(-1)
    else:
        d = weight.reshape(weight.shape[0], -1, GROUP).abs().amax(-1) / 127
        q = torch.round(weight.reshape(weight.shape[0], -1, GROUP) / d[..., None]).long()
        whole = torch.einsum("rgk,ogk->rog", rows, q).double()
        terms = whole * d.double()[None] * scale.double()[:, None]
    return terms.sum(-1), terms.abs().sum(-1)


@needs_kernel
def test_the_activations_are_quantized_as_gguf_q8_0():
    torch.manual_seed(2)
    x = torch.randn(64, 576) * torch.logspace(-3, 2, 64)[:, None]
    x[3, :GROUP] = 0  # an all-zero group: scale 0, codes 0
    x[5, 40] = 1e4  # an outlier takes its group's largest code
    codes, scale, sums = exact_codes.kernels().quantize_rows(x.contiguous())
    expected = q8_0_rows(x)
    assert torch.equal(codes, expected[0])
    assert torch.equal(scale, expected[1])
    assert torch.equal(sums, expected[2])
    assert codes.abs().max() == 127 and scale[3, 0] == 0


@needs_kernel
def test_products_are_the_exact_integer_sums_scaled_and_each_row_is_computed_alone(coded_q8):
    linear, layer, output = coded_q8
    for weight, bits in ((layer, 4), (output, 8)):
        for rows in (1, 2, 3, 5, 12, 13, 40):  # past 12 rows (3 with AVX2) the kernel sweeps the codes again
            x = torch.randn(rows, weight.shape[1])
            together = linear(x, weight)
            expected, magnitude = q8_reference(x, weight, bits)
            # a float32 accumulation over the groups of terms that are exact up to two roundings
            bound = (weight.shape[1] // GROUP + 3) * 2.0**-24 * magnitude
            assert ((together.double() - expected).abs() <= bound).all()
            # and close to the float32 product: 8-bit activations lose ~1/254 of each group's largest
            dense = F.linear(x, weight)
            assert (together - dense).norm() < 0.02 * dense.norm()
            alone = torch.cat([linear(x[i : i + 1], weight) for i in range(rows)])
            assert torch.equal(together, alone), f"{rows} rows differ from one at a time"


@needs_kernel
@pytest.mark.parametrize("threads", (2, 3))
def test_products_on_helper_threads_are_the_same_bits(coded_q8, threads):
    linear, layer, output = coded_q8
    kernels = exact_codes.kernels()
    before = kernels.threads()
    try:
        for weight in (layer, output):
            x = torch.randn(9, weight.shape[1])
            kernels.set_threads(1)
            alone = linear(x, weight)
            kernels.set_threads(threads)
            for _ in range(10):
                assert torch.equal(linear(x, weight), alone)
    finally:
        kernels.set_threads(before)


# Builds of the kernel for an instruction set below this CPU's: the integer sums are exact and the
# float32 part works lane by lane, so each gives the same bits as the native build.
LOWER_BUILDS = {
    "no-vnni": ("-mno-avx512vnni", "-mno-avxvnni"),  # the 16-bit pairwise sums in place of vpdpbusd
    "avx2": ("-mno-avx512f",),  # two ymm registers a vector (AVX-VNNI where the CPU has it)
}


@needs_kernel
@pytest.mark.parametrize("build", LOWER_BUILDS)
def test_a_build_for_a_lower_instruction_set_computes_the_same_bits(coded_q8, build):
    flags = exact_codes._cpu_flags()
    if build == "avx2" and "avx512f" not in flags:
        pytest.skip("this CPU builds the AVX2 kernel natively")
    if build == "no-vnni" and not ({"avx512_vnni", "avx_vnni"} & flags):
        pytest.skip("this CPU has no VNNI: its native build is the build without")
    lower = exact_codes.build_kernels(f"{exact_codes.kernel_name()}_{build.replace('-', '_')}", LOWER_BUILDS[build])
    if build == "avx2":
        assert lower.isa == "AVX2"
    linear, layer, output = coded_q8
    for weight in (layer, output):
        coded = linear.coded[weight.data_ptr()]
        product = lower.int4_q8_linear if coded.bits == 4 else lower.int8_q8_linear
        for rows in (1, 4, 13):
            x = torch.randn(rows, weight.shape[1])
            assert torch.equal(product(x, coded.records), linear(x, weight)), (build, rows)
