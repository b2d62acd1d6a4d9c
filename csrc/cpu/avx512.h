// AVX-512 pieces shared by the CPU weight kernels (weights.cpp, weights_sr.cpp).
//
// Design note.
// * Loads widen bf16 in-register (a zero extension and a shift): bf16 costs no extra pass.
// * absmax is a max over the integer bits of |x|: finite non-negative floats order like their bits, and
//   NaN/Inf show up as bits >= 0x7f800000, so one pass also finds non-finite blocks. bf16 values are
//   compared on their 16 bits, 32 at a time.
// * fp8 (e4m3fn / e5m2) magnitudes are rounded by the FPU: with M mantissa bits and
//   E = max(exponent of a, emin) (emin, the smallest normal exponent, also serves the subnormals),
//   adding magic = 2^(E + 23 - M) to a rounds a to the fp8 grid of its binade (ulp 2^(E - M)), half to
//   even, and leaves the significand m = a / ulp in [0, 2^(M+1)] in the low bits of the sum:
//   m = bits(a + magic) - bits(magic). The code is (E - emin) * 2^M + m (m at 2^(M+1) carries into the
//   next exponent; a subnormal that rounds up to 2^M is the smallest normal). Every step is exact, so
//   these are c10's codes (fp8.h's f32_to_e4m3 / f32_to_e5m2) for a in [0, Q].
// Header-only and inline: each kernel's loops inline them. Only built where the compiler targets
// AVX-512 (-march=native on these machines); the kernels keep scalar loops for everything else.
#pragma once

#include "isa.h"

#if PPQ_ISA_AVX512
#include <immintrin.h>

#include <cstdint>

namespace ppq::avx512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane-wise maxima of |x| bits over len values (len a positive multiple of 16): 16 u32 lanes whose max
// is the bits of max |x| (bf16: the 16-bit maxima, to shift left by 16).
inline __m512i block_max_lanes(const float* p, int64_t len) {
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  __m512i m = _mm512_and_si512(_mm512_loadu_si512(p), mask);
  for (int64_t i = 16; i < len; i += 16) m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(p + i), mask));
  return m;
}
inline __m512i block_max_lanes(const uint16_t* p, int64_t len) {
  const __m512i mask = _mm512_set1_epi16(0x7fff);
  __m512i m = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(p + i), mask));
  if (i < len) {  // 16 left
    const __m512i t = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    m = _mm512_max_epu16(m, _mm512_and_si512(t, mask));
  }
  return _mm512_max_epu32(_mm512_and_si512(m, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(m, 16));
}

// Bits of max |x| over len values (a positive multiple of 16); >= 0x7f800000 when some are NaN/Inf.
inline uint32_t absmax_bits(const float* p, int64_t len) { return _mm512_reduce_max_epu32(block_max_lanes(p, len)); }
inline uint32_t absmax_bits(const uint16_t* p, int64_t len) {
  return _mm512_reduce_max_epu32(block_max_lanes(p, len)) << 16;
}

// Round-to-nearest-even fp8 codes of 16 magnitudes a in [0, Q] (see the design note).
template <bool E4M3>
inline __m512i fp8_rne16(__m512 a) {
  constexpr int M = E4M3 ? 3 : 2;
  constexpr int magic_min = ((E4M3 ? -6 : -14) + 127 + 23 - M) << 23;  // magic's bits at E = emin
  const __m512i expo = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7f800000));
  const __m512i magic = _mm512_max_epi32(_mm512_add_epi32(expo, _mm512_set1_epi32((23 - M) << 23)),
                                         _mm512_set1_epi32(magic_min));
  const __m512i t = _mm512_castps_si512(_mm512_add_ps(a, _mm512_castsi512_ps(magic)));
  const __m512i hi = _mm512_srli_epi32(_mm512_sub_epi32(magic, _mm512_set1_epi32(magic_min)), 23 - M);
  return _mm512_add_epi32(_mm512_sub_epi32(t, magic), hi);
}

// Values of 16 non-negative finite fp8 codes (one per 32-bit lane): fp8.h's e4m3_to_f32 / e5m2_to_f32
// without the sign and the NaN/Inf codes, which callers that meet them add.
template <bool E4M3>
inline __m512 fp8_value16(__m512i c) {
  constexpr int M = E4M3 ? 3 : 2;
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(c, 23 - M), _mm512_set1_epi32((E4M3 ? 120 : 112) << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(E4M3 ? 0x1p-9f : 0x1p-16f));
  const __mmask16 is_normal = _mm512_cmpge_epi32_mask(c, _mm512_set1_epi32(1 << M));
  return _mm512_mask_blend_ps(is_normal, sub, _mm512_castsi512_ps(normal));
}

}  // namespace ppq::avx512

#endif  // PPQ_ISA_AVX512
