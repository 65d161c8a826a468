// Float32 products x @ W.T with W held as the 4- or 8-bit codes it was stored in (GGUF's Q4_1
// and Q8_0), dequantized in registers to exactly the float32 weights; and the same products on
// activations quantized to 8 bits (`*_q8_linear`, llm.weights=int4-q8: codes.h, "8-bit activations"). The Python side
// (pipeline/llm/exact_codes.py) packs the codes and checks that they reproduce the weights.
//
// Layout: the output features go in blocks of 16, one simd::Vec (simd16.h: one AVX-512 register, or
// two AVX2 registers; the records are the same on both), so a block's 16 dot products advance
// together and no horizontal sums are needed. A weight matrix is a uint8
// tensor [N/16, K/32, record]: per block, one record per group of 32 inputs, read as one
// stream (the scales beside their codes):
//   int4: 16 float16 scales, 16 float16 lows, 256 bytes of codes (two inputs a byte)
//   int8: 16 float16 scales, 512 bytes of codes (signed)
// w = scale * q + low (int4) or scale * q (int8). GGUF stores scales and lows in float16, so
// they convert exactly; the checker makes sure scale * q is exact in float32, so the fused
// multiply-add rounds once, as torch's two operations do.
//
// Each activation row accumulates in the same order whatever the number of rows in the call,
// so a row's result does not depend on the rows beside it (a verification pass reproduces a
// one-token step bit for bit).
#include <torch/extension.h>
#include "codes.h"

namespace {

using specvox::kInt4Record;
using specvox::kInt8Record;
using specvox::kLanes;
using specvox::kGroup;

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& records, int64_t record_bytes, bool int4,
                     bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-d float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = records.size(0) * kLanes;
  TORCH_CHECK(records.scalar_type() == torch::kUInt8 && records.is_contiguous() && records.dim() == 3 &&
              K % kGroup == 0 && records.size(1) == K / kGroup && records.size(2) == record_bytes,
              "the coded weight does not match x's width");
  auto out = torch::empty({M, N}, x.options());
  specvox::coded_product(x.data_ptr<float>(), M, K, records.data_ptr<uint8_t>(), out.data_ptr<float>(), N, int4,
                         int8_activations);
  return out;
}

// x [M, K] as the 8-bit activations the int4-q8 products compute on: codes int8 [M, K], scales
// float32 [M, K/32], sums of each group's codes int32 [M, K/32] (tests check them against torch)
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) % kGroup == 0,
              "x must be a contiguous 2-d float32 tensor, its width a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  auto codes = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M, K / kGroup}, x.options());
  auto sum = torch::empty({M, K / kGroup}, x.options().dtype(torch::kInt32));
  specvox::quantize_rows(x.data_ptr<float>(), M, K, codes.data_ptr<int8_t>(), scale.data_ptr<float>(),
                         sum.data_ptr<int32_t>());
  return {codes, scale, sum};
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor records) { return linear(x, records, kInt4Record, true, false); }
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor records) { return linear(x, records, kInt8Record, false, false); }
torch::Tensor int4_q8_linear(torch::Tensor x, torch::Tensor records) { return linear(x, records, kInt4Record, true, true); }
torch::Tensor int8_q8_linear(torch::Tensor x, torch::Tensor records) { return linear(x, records, kInt8Record, false, true); }

void register_lean_step(pybind11::module& m);  // lean_step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = specvox::simd::kIsa;  // what -march=native compiled: "AVX-512" or "AVX2"
  // the products release the GIL: the llm service's other threads go on meanwhile
  m.def("int4_linear", &int4_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x @ W.T, W as records of 4-bit codes, a float16 scale and low per 32");
  m.def("int8_linear", &int8_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x @ W.T, W as records of 8-bit codes, a float16 scale per 32");
  m.def("int4_q8_linear", &int4_q8_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x @ W.T on x quantized to 8 bits per 32, W as dot-order records of 4-bit codes (llm.weights=int4-q8)");
  m.def("int8_q8_linear", &int8_q8_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x @ W.T on x quantized to 8 bits per 32, W as dot-order records of 8-bit codes (llm.weights=int4-q8)");
  m.def("quantize_rows", &quantize_rows, "x as the int4-q8 products' 8-bit activations: codes, scales, sums");
  m.def("set_threads", [](int threads) { return specvox::Pool::instance().set_threads(threads); },
        "threads for the kernels' loops, the caller's included (1: the caller alone); the count in force");
  m.def("threads", [] { return specvox::Pool::instance().threads(); }, "threads the kernels' loops run on");
  m.def("pool_counts", [] {
    const auto c = specvox::Pool::instance().counts();
    return pybind11::dict(pybind11::arg("shared_loops") = c.shared_loops, pybind11::arg("solo_loops") = c.solo_loops,
                          pybind11::arg("shared_work_per_s") = c.shared_rate, pybind11::arg("solo_work_per_s") = c.solo_rate);
  }, "loops run shared and alone since the process started, and each way's latest work a second (kernels/pool.h)");
  register_lean_step(m);
}
