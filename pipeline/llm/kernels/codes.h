// The 4- and 8-bit code products shared by exact_codes.cpp (one product a call) and
// lean_step.cpp (a whole decoding pass in one call). See exact_codes.cpp for the layout.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace specvox {


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

// All blocks of 16 output features for `rows` activation rows (at::parallel_for: on one thread, as
// exact_codes.py builds the extension without OpenMP; see KERNEL_FLAGS there).
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

// out[M, N] = x[M, K] @ W.T, W as records; rows in sweeps of kRowsPerSweep (each row's sums in
// the same order whatever M).
inline void product(const float* x, int64_t M, int64_t K, const uint8_t* records, float* out, int64_t N, bool int4) {
  for (int64_t r0 = 0; r0 < M; r0 += kRowsPerSweep) {
    const int64_t rows = std::min<int64_t>(kRowsPerSweep, M - r0);
    if (int4) {
      sweep<Int4Codes>(rows, x + r0 * K, K, records, out + r0 * N, N);
    } else {
      sweep<Int8Codes>(rows, x + r0 * K, K, records, out + r0 * N, N);
    }
  }
}

}  // namespace specvox
