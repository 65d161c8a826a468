// The 4- and 8-bit code products shared by exact_codes.cpp (one product a call) and
// lean_step.cpp (a whole decoding pass in one call). See exact_codes.cpp for the layout.
// Written once on simd16.h's 16-lane vector (one AVX-512 register, or two AVX2 registers).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "simd16.h"

namespace specvox {

using simd::Vec;

constexpr int64_t kLanes = 16;          // output features per block: one simd::Vec
constexpr int64_t kGroup = 32;          // inputs per scale
constexpr int64_t kInt4Record = 64 + kGroup / 2 * kLanes;  // 16 float16 scales, 16 float16 lows, 256 bytes of codes
constexpr int64_t kInt8Record = 32 + kGroup * kLanes;      // 16 float16 scales, 512 bytes of codes
// Activation rows sharing one pass over the codes: each row's two accumulators (block_product) stay in
// registers beside the dequantized pair, the scales and the lows.
#if SPECVOX_AVX512
constexpr int kRowsPerSweep = 12;       // 24 accumulators and the rest in AVX-512's 32 zmm
#else
// AVX2 takes a record's 16 lanes 8 at a time for three rows or more (block_product_halves), so
// a row's two accumulators are two of the 16 ymm registers. Measured on a Zen 3 (2026-12-03,
// docs/benchmarks/history.md), a step's products at nine rows: 45 ms at 5 (5 + 4), 46 at 6, 56 at 4,
// against 59 for the 16-lane kernel at 4 rows a sweep; one row ~10 ms either way.
#ifndef SPECVOX_ROWS_AVX2
#define SPECVOX_ROWS_AVX2 5
#endif
constexpr int kRowsPerSweep = SPECVOX_ROWS_AVX2;
#endif
constexpr int64_t kPrefetch = 4096;     // bytes fetched ahead: the hardware prefetcher alone left the loop
                                        // waiting on memory (2.2 GB/s); 1-8 KiB ahead all do about as well

inline void prefetch_record(const uint8_t* record, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char*)record + kPrefetch + line, _MM_HINT_T0);
}

// A record's weights for 16 output features, two inputs at a time. 4 bits: [16 float16
// scales][16 float16 lows][256 bytes of codes], lane t of pair p holding q[t, 2p] | q[t, 2p+1] << 4.
struct Int4Codes {
  static constexpr int64_t kRecord = kInt4Record;
  Vec scale, low;
  const uint8_t* codes;
  explicit Int4Codes(const uint8_t* record)
      : scale(simd::halves(record)), low(simd::halves(record + 32)), codes(record + 64) {}
  void pair(int64_t p, Vec& w0, Vec& w1) const {
    Vec q0, q1;
    simd::nibbles(codes + p * kLanes, q0, q1);
    w0 = simd::fmadd(q0, scale, low);
    w1 = simd::fmadd(q1, scale, low);
  }
};

// 8 bits: [16 float16 scales][512 bytes of codes], one signed byte a weight, input by input.
struct Int8Codes {
  static constexpr int64_t kRecord = kInt8Record;
  Vec scale;
  const uint8_t* codes;
  explicit Int8Codes(const uint8_t* record) : scale(simd::halves(record)), codes(record + 32) {}
  void pair(int64_t p, Vec& w0, Vec& w1) const {
    w0 = simd::mul(simd::signed_bytes(codes + 2 * p * kLanes), scale);
    w1 = simd::mul(simd::signed_bytes(codes + (2 * p + 1) * kLanes), scale);
  }
};

// One block of 16 output features for M activation rows; the block's records are one stream.
template <class Codes, int M>
void block_product(const float* x, int64_t K, const uint8_t* records, float* out, int64_t N, int64_t block) {
  // Two accumulators a row (even and odd inputs): one chain of fused multiply-adds waits on
  // the last one's latency. Same order for any M, so each row's sum is the same in any call.
  Vec even[M], odd[M];
  for (int r = 0; r < M; ++r) even[r] = odd[r] = simd::zero();
  const int64_t groups = K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = records + (block * groups + g) * Codes::kRecord;
    prefetch_record(record, Codes::kRecord);
    const Codes codes(record);
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      Vec w0, w1;
      codes.pair(p, w0, w1);
      const int64_t i = g * kGroup + 2 * p;
      for (int r = 0; r < M; ++r) {
        even[r] = simd::fmadd(simd::set1(x[r * K + i]), w0, even[r]);
        odd[r] = simd::fmadd(simd::set1(x[r * K + i + 1]), w1, odd[r]);
      }
    }
  }
  for (int r = 0; r < M; ++r) simd::storeu(out + r * N + block * kLanes, simd::add(even[r], odd[r]));
}

#if !SPECVOX_AVX512
// AVX2, three rows or more: half a record's lanes (8 output features, one ymm register) at a time,
// so that a row's two accumulators take two registers, not four, and 5 rows share a sweep without
// spilling (with a Vec of two ymm, 2 rows fit and 4 spilled: nine rows cost 5.5 one-row passes).
// Lane by lane the operations and their order are block_product's, so the results are the same
// bits; one or two rows stay on block_product, which reads a record once, not twice.
struct Int4Half {
  static constexpr int64_t kRecord = kInt4Record;
  __m256 scale, low;
  const uint8_t* codes;
  Int4Half(const uint8_t* record, int half)
      : scale(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(record + 16 * half)))),
        low(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(record + 32 + 16 * half)))),
        codes(record + 64 + 8 * half) {}
  void pair(int64_t p, __m256& w0, __m256& w1) const {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + p * kLanes)));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))), scale, low);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), scale, low);
  }
};

struct Int8Half {
  static constexpr int64_t kRecord = kInt8Record;
  __m256 scale;
  const uint8_t* codes;
  Int8Half(const uint8_t* record, int half)
      : scale(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(record + 16 * half)))), codes(record + 32 + 8 * half) {}
  void pair(int64_t p, __m256& w0, __m256& w1) const {
    w0 = _mm256_mul_ps(simd::signed_bytes8(codes + 2 * p * kLanes), scale);
    w1 = _mm256_mul_ps(simd::signed_bytes8(codes + (2 * p + 1) * kLanes), scale);
  }
};

template <class Codes> struct HalfOf;
template <> struct HalfOf<Int4Codes> { using type = Int4Half; };
template <> struct HalfOf<Int8Codes> { using type = Int8Half; };

template <class Codes, int M>
void block_product_halves(const float* x, int64_t K, const uint8_t* records, float* out, int64_t N, int64_t block) {
  using Half = typename HalfOf<Codes>::type;
  const int64_t groups = K / kGroup;
  const uint8_t* first = records + block * groups * Codes::kRecord;
  for (int half = 0; half < 2; ++half) {  // the second half reads the block's records from L1
    __m256 even[M], odd[M];
    for (int r = 0; r < M; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* record = first + g * Codes::kRecord;
      if (half == 0) prefetch_record(record, Codes::kRecord);
      const Half codes(record, half);
      for (int64_t p = 0; p < kGroup / 2; ++p) {
        __m256 w0, w1;
        codes.pair(p, w0, w1);
        const int64_t i = g * kGroup + 2 * p;
        for (int r = 0; r < M; ++r) {
          even[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * K + i]), w0, even[r]);
          odd[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * K + i + 1]), w1, odd[r]);
        }
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + r * N + block * kLanes + 8 * half, _mm256_add_ps(even[r], odd[r]));
  }
}
#endif

// All blocks of 16 output features for `rows` activation rows, shared with the pool's helpers
// (pool.h; `llm.kernel_threads`) in chunks of blocks: a block is computed whole by one thread, so
// which thread computes it changes no bit. About 32 chunks a thread keep the shares even and a chunk short.
// One instantiation per row count (1..kRowsPerSweep) keeps the accumulators in registers. The pool's
// chooser weighs a sweep by its rows × inputs × blocks.
template <class Codes, int M = kRowsPerSweep>
void sweep(int64_t rows, const float* x, int64_t K, const uint8_t* records, float* out, int64_t N) {
  if constexpr (M > 1) {
    if (rows < M) return sweep<Codes, M - 1>(rows, x, K, records, out, N);
  }
  const int64_t blocks = N / kLanes;
  parallel_for(0, blocks, std::max<int64_t>(1, blocks / (32 * Pool::instance().threads())), [&](int64_t b0, int64_t b1) {
#if !SPECVOX_AVX512
    if constexpr (M > 2) {
      for (int64_t b = b0; b < b1; ++b) block_product_halves<Codes, M>(x, K, records, out, N, b);
      return;
    }
#endif
    for (int64_t b = b0; b < b1; ++b) block_product<Codes, M>(x, K, records, out, N, b);
  }, static_cast<double>(M) * static_cast<double>(K) * static_cast<double>(blocks), Pool::product_kind(M));
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

// ---- Products on 8-bit activations (llm.weights=int4-q8) ----
// The activations are quantized per group of 32 inputs as GGUF's Q8_0 is, a = da · qa with da =
// max|a| / 127 and qa whole in −127..127 (ties to even), row by row; a group's dot product with the
// weights' codes is then a sum of integer products, exact, taken 4 at a time by one instruction
// (VNNI's vpdpbusd; without it two), where the float32 path spends one fused multiply-add a weight.
// The float32 part is a group's few scalings, lane by lane, in the same order for every row, so
// rows stay independent of one another, and of the thread count and instruction set.
// This is llama.cpp's arithmetic for Q4_1 × Q8_0 (ggml's vec_dot), not float32's: outputs are the
// form's own, which speculative decoding reproduces exactly (each row computed alone).

// x [M, K] quantized per group of 32: codes [M, K], scale [M, K/32], sum of the group's codes [M, K/32]
struct QuantizedRows {
  const int8_t* codes;
  const float* scale;
  const int32_t* sum;
  const float* scaled_sum;  // scale · sum, the 4-bit codes' low term's factor (rounded as Int4DotCodes::finish did)
  int64_t K;
  int32_t four(int64_t r, int64_t i) const {  // codes i .. i+3 of row r as one int32 (dot4's operand)
    int32_t v;
    std::memcpy(&v, codes + r * K + i, 4);
    return v;
  }
};

// Row r of x [M, K] quantized group by group into codes, scale and sum (QuantizedRows' arrays).
inline void quantize_row(const float* x, int64_t r, int64_t K, int8_t* codes, float* scale, int32_t* sum,
                         float* scaled_sum = nullptr) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* in = x + r * K + g * kGroup;
    int8_t* q = codes + r * K + g * kGroup;
    const Vec a = simd::loadu(in), b = simd::loadu(in + 16);
    const float top = std::max(simd::max_abs(a), simd::max_abs(b));
    const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
    simd::store_rounded_bytes(q, simd::mul(a, simd::set1(inverse)));
    simd::store_rounded_bytes(q + 16, simd::mul(b, simd::set1(inverse)));
    int32_t total = 0;
    for (int64_t i = 0; i < kGroup; ++i) total += q[i];
    const float da = top / 127.0f;
    scale[r * (K / kGroup) + g] = da;
    sum[r * (K / kGroup) + g] = total;
    if (scaled_sum != nullptr) scaled_sum[r * (K / kGroup) + g] = da * static_cast<float>(total);
  }
}

// Rows shared with the pool's helpers where there are several (a prompt's); each row is quantized alone.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* codes, float* scale, int32_t* sum,
                          float* scaled_sum = nullptr) {
  parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x, r, K, codes, scale, sum, scaled_sum);
  }, static_cast<double>(M) * static_cast<double>(K), Pool::kOther);
}

// Both record kinds unroll their loop over a group's vectors: rolled, GCC copied every row's integer
// sum from one register to another each round. With that and the low term's scale · sum taken from
// the quantized rows (not a conversion, a product and a broadcast a row and group), a 3072×576 product
// on 74 rows ran at 192 GMAC/s on one core, against 140 (Intel Xeon, AVX-512 VNNI, 2026-12-05); the
// same bits.
// 4-bit codes in dot-product order: [16 float16 scales][16 float16 lows][4 vectors of 64 bytes], byte
// 4t+k of vector j holding q[t, 8j+k] | q[t, 8j+4+k] << 4 (inputs 8j..8j+3 low, 8j+4..8j+7 high).
// w = d·q + m, so a group's dot product is d·da·Σ q·qa + m·da·Σ qa.
struct Int4DotCodes {
  static constexpr int64_t kRecord = kInt4Record;
  const uint8_t* record;
  Vec scale, low;
  explicit Int4DotCodes(const uint8_t* r) : record(r), scale(simd::halves(r)), low(simd::halves(r + 32)) {}
  template <int M>
  void accumulate(simd::IVec (&isum)[M], const QuantizedRows& a, int64_t r0, int64_t i0) const {
#pragma GCC unroll 4
    for (int64_t j = 0; j < 4; ++j) {
      simd::IVec low, high;
      simd::split_nibbles(simd::load_bytes(record + 64 + 64 * j), low, high);
      for (int r = 0; r < M; ++r) {
        isum[r] = simd::dot4<true>(isum[r], low, a.four(r0 + r, i0 + 8 * j));
        isum[r] = simd::dot4<true>(isum[r], high, a.four(r0 + r, i0 + 8 * j + 4));
      }
    }
  }
  Vec finish(Vec acc, simd::IVec isum, const QuantizedRows& a, int64_t at) const {
    acc = simd::fmadd(simd::to_float(isum), simd::mul(scale, simd::set1(a.scale[at])), acc);
    return simd::fmadd(low, simd::set1(a.scaled_sum[at]), acc);
  }
};

// 8-bit codes in dot-product order: [16 float16 scales][8 vectors of 64 bytes], byte 4t+k of vector j
// holding q[t, 4j+k] + 128 (unsigned, as vpdpbusd takes them); Σ (q+128)·qa − 128·Σ qa = Σ q·qa.
struct Int8DotCodes {
  static constexpr int64_t kRecord = kInt8Record;
  const uint8_t* record;
  Vec scale;
  explicit Int8DotCodes(const uint8_t* r) : record(r), scale(simd::halves(r)) {}
  template <int M>
  void accumulate(simd::IVec (&isum)[M], const QuantizedRows& a, int64_t r0, int64_t i0) const {
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) {
      const simd::IVec u = simd::load_bytes(record + 32 + 64 * j);
      for (int r = 0; r < M; ++r) isum[r] = simd::dot4<false>(isum[r], u, a.four(r0 + r, i0 + 4 * j));
    }
  }
  Vec finish(Vec acc, simd::IVec isum, const QuantizedRows& a, int64_t at) const {
    return simd::fmadd(simd::to_float(simd::isub(isum, 128 * a.sum[at])), simd::mul(scale, simd::set1(a.scale[at])), acc);
  }
};

// One block of 16 output features for rows r0 .. r0+M−1 of a: per group, an integer sum per row, then
// its scaling into the row's float32 accumulator.
template <class Codes, int M>
void block_product_q8(const QuantizedRows& a, int64_t r0, const uint8_t* records, float* out, int64_t N, int64_t block) {
  Vec acc[M];
  for (int r = 0; r < M; ++r) acc[r] = simd::zero();
  const int64_t groups = a.K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = records + (block * groups + g) * Codes::kRecord;
    prefetch_record(record, Codes::kRecord);
    const Codes codes(record);
    simd::IVec isum[M];
    for (int r = 0; r < M; ++r) isum[r] = simd::izero();
    codes.template accumulate<M>(isum, a, r0, g * kGroup);
    for (int r = 0; r < M; ++r) {
      const int64_t at = (r0 + r) * groups + g;
      acc[r] = codes.finish(acc[r], isum[r], a, at);
    }
  }
  for (int r = 0; r < M; ++r) simd::storeu(out + (r0 + r) * N + block * kLanes, acc[r]);
}

// Activation rows sharing one pass over the codes: a row's integer and float accumulators are two
// registers; AVX2's are two each (16 ymm: fewer rows).
#if SPECVOX_AVX512
constexpr int kQ8RowsPerSweep = 12;
#else
constexpr int kQ8RowsPerSweep = 3;
#endif

// Rows r0 .. r0+rows−1 (rows ≤ kQ8RowsPerSweep) of one block: the instantiation for that row count.
template <class Codes, int M = kQ8RowsPerSweep>
void block_rows_q8(const QuantizedRows& a, int64_t r0, int64_t rows, const uint8_t* records, float* out, int64_t N,
                   int64_t block) {
  if constexpr (M > 1) {
    if (rows < M) return block_rows_q8<Codes, M - 1>(a, r0, rows, records, out, N, block);
  }
  block_product_q8<Codes, M>(a, r0, records, out, N, block);
}

// out[M, N] = x[M, K] @ W.T on 8-bit activations (x quantized here, row by row); W as dot-order records.
// A block's sweeps of kQ8RowsPerSweep rows follow one another while its records are in the core's
// cache: a prompt's rows read the codes from memory once, not once a sweep (76 rows: 7 sweeps, the
// codes read 7 times, were bound by memory). Each row is computed as in any other call.
inline void product_q8(const float* x, int64_t M, int64_t K, const uint8_t* records, float* out, int64_t N, bool int4) {
  std::vector<int8_t> codes(M * K);
  std::vector<float> scale(M * (K / kGroup));
  std::vector<int32_t> sum(M * (K / kGroup));
  std::vector<float> scaled_sum(M * (K / kGroup));
  quantize_rows(x, M, K, codes.data(), scale.data(), sum.data(), scaled_sum.data());
  const QuantizedRows a{codes.data(), scale.data(), sum.data(), scaled_sum.data(), K};
  const int64_t blocks = N / kLanes;
  parallel_for(0, blocks, std::max<int64_t>(1, blocks / (32 * Pool::instance().threads())), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r0 = 0; r0 < M; r0 += kQ8RowsPerSweep) {
        const int64_t rows = std::min<int64_t>(kQ8RowsPerSweep, M - r0);
        if (int4) {
          block_rows_q8<Int4DotCodes>(a, r0, rows, records, out, N, b);
        } else {
          block_rows_q8<Int8DotCodes>(a, r0, rows, records, out, N, b);
        }
      }
    }
  }, static_cast<double>(M) * static_cast<double>(K) * static_cast<double>(blocks), Pool::product_kind(M));
}

// out[M, N] = x[M, K] @ W.T in a form's arithmetic: on float32 activations (int4-exact) or on 8-bit
// ones (int4-q8, `int8_activations`: W's records in dot-product order); 4- or 8-bit records.
inline void coded_product(const float* x, int64_t M, int64_t K, const uint8_t* records, float* out, int64_t N,
                          bool int4, bool int8_activations) {
  if (int8_activations) {
    product_q8(x, M, K, records, out, N, int4);
  } else {
    product(x, M, K, records, out, N, int4);
  }
}

}  // namespace specvox
