// Float32 products x @ W.T with W held as the 4- or 8-bit codes it was stored in (GGUF's Q4_1
// and Q8_0), dequantized in registers to exactly the float32 weights. The Python side
// (pipeline/llm/exact_codes.py) packs the codes and checks that they reproduce the weights.
//
// Layout: the output features go in blocks of 16, one AVX-512 register, so a block's 16 dot
// products advance together and no horizontal sums are needed. A weight matrix is a uint8
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
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;          // output features per block
constexpr int64_t kGroup = 32;          // inputs per scale
constexpr int64_t kInt4Record = 64 + kGroup / 2 * kLanes;  // 16 float16 scales, 16 float16 lows, 256 bytes of codes
constexpr int64_t kInt8Record = 32 + kGroup * kLanes;      // 16 float16 scales, 512 bytes of codes
constexpr int kRowsPerSweep = 12;       // activation rows sharing one pass over the codes (their 24
                                        // accumulators and the dequantized weights fit AVX-512's 32 registers)
constexpr int64_t kPrefetch = 4096;     // bytes fetched ahead: the hardware prefetcher alone left the loop
                                        // waiting on memory (2.2 GB/s); 1-8 KiB ahead all do about as well

inline __m512 halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// 16 signed bytes as 16 floats
inline __m512 signed_bytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

inline void prefetch_record(const uint8_t* record, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char*)record + kPrefetch + line, _MM_HINT_T0);
}

// A record's weights for 16 output features, two inputs at a time. 4 bits: [16 float16
// scales][16 float16 lows][256 bytes of codes], lane t of pair p holding q[t, 2p] | q[t, 2p+1] << 4.
struct Int4Codes {
  static constexpr int64_t kRecord = kInt4Record;
  __m512 scale, low;
  const uint8_t* codes;
  explicit Int4Codes(const uint8_t* record) : scale(halves(record)), low(halves(record + 32)), codes(record + 64) {}
  void pair(int64_t p, __m512& w0, __m512& w1) const {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + p * kLanes)));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), scale, low);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), scale, low);
  }
};

// 8 bits: [16 float16 scales][512 bytes of codes], one signed byte a weight, input by input.
struct Int8Codes {
  static constexpr int64_t kRecord = kInt8Record;
  __m512 scale;
  const uint8_t* codes;
  explicit Int8Codes(const uint8_t* record) : scale(halves(record)), codes(record + 32) {}
  void pair(int64_t p, __m512& w0, __m512& w1) const {
    w0 = _mm512_mul_ps(signed_bytes(codes + 2 * p * kLanes), scale);
    w1 = _mm512_mul_ps(signed_bytes(codes + (2 * p + 1) * kLanes), scale);
  }
};

// One block of 16 output features for M activation rows; the block's records are one stream.
template <class Codes, int M>
void block_product(const float* x, int64_t K, const uint8_t* records, float* out, int64_t N, int64_t block) {
  // Two accumulators a row (even and odd inputs): one chain of fused multiply-adds waits on
  // the last one's latency. Same order for any M, so each row's sum is the same in any call.
  __m512 even[M], odd[M];
  for (int r = 0; r < M; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const int64_t groups = K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = records + (block * groups + g) * Codes::kRecord;
    prefetch_record(record, Codes::kRecord);
    const Codes codes(record);
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      __m512 w0, w1;
      codes.pair(p, w0, w1);
      const int64_t i = g * kGroup + 2 * p;
      for (int r = 0; r < M; ++r) {
        even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + i]), w0, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + i + 1]), w1, odd[r]);
      }
    }
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(out + r * N + block * kLanes, _mm512_add_ps(even[r], odd[r]));
}

// All blocks of 16 output features for `rows` activation rows, split across torch's threads.
// One instantiation per row count (1..kRowsPerSweep) keeps the accumulators in registers.
template <class Codes, int M = kRowsPerSweep>
void sweep(int64_t rows, const float* x, int64_t K, const uint8_t* records, float* out, int64_t N) {
  if constexpr (M > 1) {
    if (rows < M) return sweep<Codes, M - 1>(rows, x, K, records, out, N);
  }
  at::parallel_for(0, N / kLanes, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block_product<Codes, M>(x, K, records, out, N, b);
  });
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& records, int64_t record_bytes, bool int4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-d float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = records.size(0) * kLanes;
  TORCH_CHECK(records.scalar_type() == torch::kUInt8 && records.is_contiguous() && records.dim() == 3 &&
              K % kGroup == 0 && records.size(1) == K / kGroup && records.size(2) == record_bytes,
              "the coded weight does not match x's width");
  auto out = torch::empty({M, N}, x.options());
  for (int64_t r0 = 0; r0 < M; r0 += kRowsPerSweep) {
    const int64_t rows = std::min<int64_t>(kRowsPerSweep, M - r0);
    const float* xr = x.data_ptr<float>() + r0 * K;
    float* o = out.data_ptr<float>() + r0 * N;
    if (int4) {
      sweep<Int4Codes>(rows, xr, K, records.data_ptr<uint8_t>(), o, N);
    } else {
      sweep<Int8Codes>(rows, xr, K, records.data_ptr<uint8_t>(), o, N);
    }
  }
  return out;
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor records) { return linear(x, records, kInt4Record, true); }
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor records) { return linear(x, records, kInt8Record, false); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "x @ W.T, W as records of 4-bit codes, a float16 scale and low per 32");
  m.def("int8_linear", &int8_linear, "x @ W.T, W as records of 8-bit codes, a float16 scale per 32");
}
