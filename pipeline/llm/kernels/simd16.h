// 16 float32 lanes: the one vector type of the int4-exact kernels (codes.h, lean_step.cpp), so that
// each kernel is written once for both instruction sets exact_codes.py builds for (-march=native):
//   AVX-512F and BW:        a Vec is one zmm register (32 of them);
//   AVX2 with FMA and F16C: a Vec is two ymm registers, lanes 0-7 and 8-15 (16 of them).
// Every operation but `sum` is lane by lane and rounds as its AVX-512 instruction does (fused
// multiply-adds round once on both); `sum` adds the 16 lanes in an order of each ISA's own, fixed
// for that ISA. So whatever a kernel guarantees about its order of operations (each row summed in
// the same order however many rows a call has) holds on either ISA; between the two, results may
// differ in the last bits where a kernel sums across lanes. The integer part (IVec, for products on
// 8-bit activations) is exact, so it gives the same numbers on either, with VNNI or without.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SPECVOX_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECVOX_AVX512 0
#else
#error "the int4-exact kernels need AVX-512F and BW, or AVX2 with FMA and F16C (exact_codes.py compiles with -march=native)"
#endif

namespace specvox::simd {

#if SPECVOX_AVX512

constexpr const char* kIsa = "AVX-512";

struct Vec {
  __m512 v;
};

inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec loadu(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void storeu(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a·b + c, rounded once
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c − a·b, rounded once
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float sum(Vec a) { return _mm512_reduce_add_ps(a.v); }

// 16 float16 (32 bytes) as floats: exact
inline Vec halves(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }

// 16 signed bytes as floats
inline Vec signed_bytes(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}

// 16 bytes' low and high 4 bits as floats (0..15)
inline void nibbles(const uint8_t* p, Vec& low, Vec& high) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  low = {_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)))};
  high = {_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))};
}

// The first n lanes (0 ≤ n ≤ 16); the others are 0 and never read or written.
inline __mmask16 first(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
inline Vec load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline void store_first(float* p, Vec a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline Vec keep_first(Vec a, int64_t n) { return {_mm512_maskz_mov_ps(first(n), a.v)}; }

inline Vec round_nearest(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// p · 2^n for whole n in −126..127, rounded once
inline Vec scale_by_power_of_two(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }


// ---- 16 int32 lanes, for the products on 8-bit activations (codes.h, llm.weights=int4-q8) ----
// A 64-byte vector of codes: byte 4t+k is lane t's k-th code. Integer sums are exact, so every
// path below (VNNI or not, AVX-512 or AVX2) gives the same numbers.
struct IVec {
  __m512i v;
};

inline IVec izero() { return {_mm512_setzero_si512()}; }
inline IVec load_bytes(const uint8_t* p) { return {_mm512_loadu_si512((const void*)p)}; }
// each byte's low and high 4 bits, as bytes 0..15
inline void split_nibbles(IVec b, IVec& low, IVec& high) {
  const __m512i mask = _mm512_set1_epi8(15);
  low = {_mm512_and_si512(b.v, mask)};
  high = {_mm512_and_si512(_mm512_srli_epi16(b.v, 4), mask)};
}
// lane t += Σ_k u[4t+k] · a_k, with u unsigned bytes and a_k the signed bytes of `a4`. `kSmall`: every u
// is below 16 (4-bit codes), which the pairwise 16-bit sums of the path without VNNI need.
template <bool kSmall>
inline IVec dot4(IVec acc, IVec u, int32_t a4) {
  const __m512i a = _mm512_set1_epi32(a4);
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, a)};
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (kSmall) return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(u.v, a), ones))};
  // u = low + 16·high, each part's pairs below 2·15·128 (no saturation)
  const __m512i mask = _mm512_set1_epi8(15);
  const __m512i low = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(u.v, mask), a), ones);
  const __m512i high = _mm512_madd_epi16(
      _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(u.v, 4), mask), a), ones);
  return {_mm512_add_epi32(acc.v, _mm512_add_epi32(low, _mm512_slli_epi32(high, 4)))};
#endif
}
inline IVec isub(IVec a, int32_t b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
inline Vec to_float(IVec a) { return {_mm512_cvtepi32_ps(a.v)}; }  // exact below 2^24
inline float max_abs(Vec a) { return _mm512_reduce_max_ps(_mm512_abs_ps(a.v)); }
// 16 floats rounded to the nearest whole number (ties to even), as signed bytes; |a| ≤ 127
inline void store_rounded_bytes(int8_t* p, Vec a) {
  _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.v)));
}

#else  // AVX2, FMA, F16C

constexpr const char* kIsa = "AVX2";

struct Vec {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float x) {
  const __m256 v = _mm256_set1_ps(x);
  return {v, v};
}
inline Vec loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float sum(Vec a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline Vec halves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
}

inline __m256 signed_bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline Vec signed_bytes(const uint8_t* p) { return {signed_bytes8(p), signed_bytes8(p + 8)}; }

inline void nibbles(const uint8_t* p, Vec& low, Vec& high) {
  const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  const __m256i mask = _mm256_set1_epi32(15);
  low = {_mm256_cvtepi32_ps(_mm256_and_si256(q0, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(q1, mask))};
  high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4))};
}

// Lanes below n of 8 (all ones), as a mask for maskload/maskstore.
inline __m256i first8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : n > 8 ? 8 : n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load_first(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, first8(n)), _mm256_maskload_ps(p + 8, first8(n - 8))};
}
inline void store_first(float* p, Vec a, int64_t n) {
  _mm256_maskstore_ps(p, first8(n), a.lo);
  _mm256_maskstore_ps(p + 8, first8(n - 8), a.hi);
}
inline Vec keep_first(Vec a, int64_t n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(first8(n))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(first8(n - 8)))};
}

inline Vec round_nearest(Vec a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p · 2^n for whole n in −126..127, rounded once: 2^n is a normal float built from its exponent
// bits, (n + 127) << 23, so one multiply gives the value AVX-512's scalef gives.
inline __m256 power_of_two8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec scale_by_power_of_two(Vec p, Vec n) {
  return {_mm256_mul_ps(p.lo, power_of_two8(n.lo)), _mm256_mul_ps(p.hi, power_of_two8(n.hi))};
}


// ---- 16 int32 lanes as two ymm registers (see the AVX-512 part) ----
struct IVec {
  __m256i lo, hi;  // lanes 0-7 (bytes 0-31), 8-15 (bytes 32-63)
};

inline IVec izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline IVec load_bytes(const uint8_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
}
inline void split_nibbles(IVec b, IVec& low, IVec& high) {
  const __m256i mask = _mm256_set1_epi8(15);
  low = {_mm256_and_si256(b.lo, mask), _mm256_and_si256(b.hi, mask)};
  high = {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), mask), _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), mask)};
}
template <bool kSmall>
inline __m256i dot4_8(__m256i acc, __m256i u, __m256i a) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, a);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kSmall) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones));
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i low = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(u, mask), a), ones);
  const __m256i high = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u, 4), mask), a), ones);
  return _mm256_add_epi32(acc, _mm256_add_epi32(low, _mm256_slli_epi32(high, 4)));
#endif
}
template <bool kSmall>
inline IVec dot4(IVec acc, IVec u, int32_t a4) {
  const __m256i a = _mm256_set1_epi32(a4);
  return {dot4_8<kSmall>(acc.lo, u.lo, a), dot4_8<kSmall>(acc.hi, u.hi, a)};
}
inline IVec isub(IVec a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline Vec to_float(IVec a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline float max_abs(Vec a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 m8 = _mm256_max_ps(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}
inline void store_rounded_bytes(int8_t* p, Vec a) {
  alignas(32) int32_t whole[16];
  _mm256_store_si256((__m256i*)whole, _mm256_cvtps_epi32(a.lo));
  _mm256_store_si256((__m256i*)(whole + 8), _mm256_cvtps_epi32(a.hi));
  for (int i = 0; i < 16; ++i) p[i] = static_cast<int8_t>(whole[i]);
}

#endif

// e^x in 16 lanes: 2^n · e^r with n = round(x / ln 2), r = x − n·ln 2 (Cody-Waite's two-part
// ln 2), e^r by its Taylor series to r^7 (|r| ≤ ln 2 / 2: truncation under 1e-8, below float32's ulp).
// x is clamped to [−87, 88], so n stays in −126..127 (2^n a normal float).
inline Vec exp(Vec x) {
  x = min(max(x, set1(-87.0f)), set1(88.0f));
  const Vec n = round_nearest(mul(x, set1(1.44269504088896341f)));
  Vec r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  Vec p = set1(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fmadd(p, r, set1(c));
  return scale_by_power_of_two(p, n);
}

}  // namespace specvox::simd
