// AVX2 (x86-64-v3) pieces shared by the CPU kernels (weights.cpp, weights_sr.cpp, codecs.cpp): the
// 8-lane counterparts of avx512.h, the same math bit for bit (see avx512.h's design note).
//
// Design note.
// * bf16 loads widen in-register (zero extension and a shift); absmax is an integer max over |x|'s
//   bits (bf16: on its 16 bits, 16 at a time), so NaN/Inf show up as bits >= 0x7f800000.
// * fp8 rounding by the FPU with a power-of-two magic (avx512.h's fp8_rne16), 8 lanes.
// * Narrowing 32-bit lanes to bytes truncates (keeps the low byte), like AVX-512's vpmovdb: mask to
//   0..255, then two unsigned-saturating packs (exact on 0..255) and one cross-lane permute. A NaN
//   converted by cvtps_epi32 (0x80000000) thus gives the byte AVX-512 and the scalar casts give.
// Header-only and inline; compiled into the avx2 module, and into the avx512 module for the loops
// that have no AVX-512 version (PPQ_HAS_AVX2, isa.h).
#pragma once

#include "isa.h"

#if PPQ_HAS_AVX2
#include <immintrin.h>

#include <cstdint>

namespace ppq::avx2 {

PPQ_ALWAYS_INLINE inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PPQ_ALWAYS_INLINE inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

PPQ_ALWAYS_INLINE inline uint32_t hmax_epu32(__m256i m) {
  __m128i x = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4e));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(x));
}

// Lane-wise maxima of |x| bits over len values (len a positive multiple of 16): 8 u32 lanes whose max
// is the bits of max |x| (bf16: the 16-bit maxima, pairwise maxed into 32-bit lanes, to shift left by 16).
PPQ_ALWAYS_INLINE inline __m256i block_max_lanes(const float* p, int64_t len) {
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mask);
  __m256i m1 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8)), mask);
  for (int64_t i = 16; i < len; i += 16) {
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)), mask));
  }
  return _mm256_max_epu32(m0, m1);
}
PPQ_ALWAYS_INLINE inline __m256i block_max_lanes(const uint16_t* p, int64_t len) {
  const __m256i mask = _mm256_set1_epi16(0x7fff);
  __m256i m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mask);
  for (int64_t i = 16; i < len; i += 16)
    m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mask));
  return _mm256_max_epu32(_mm256_and_si256(m, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(m, 16));
}

// Bits of max |x| over len values (a positive multiple of 16); >= 0x7f800000 when some are NaN/Inf.
PPQ_ALWAYS_INLINE inline uint32_t absmax_bits(const float* p, int64_t len) {
  return hmax_epu32(block_max_lanes(p, len));
}
PPQ_ALWAYS_INLINE inline uint32_t absmax_bits(const uint16_t* p, int64_t len) {
  return hmax_epu32(block_max_lanes(p, len)) << 16;
}

// Round-to-nearest-even fp8 codes of 8 magnitudes a in [0, Q] (avx512.h's fp8_rne16).
template <bool E4M3>
PPQ_ALWAYS_INLINE inline __m256i fp8_rne8(__m256 a) {
  constexpr int M = E4M3 ? 3 : 2;
  constexpr int magic_min = ((E4M3 ? -6 : -14) + 127 + 23 - M) << 23;
  const __m256i expo = _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7f800000));
  const __m256i magic = _mm256_max_epi32(_mm256_add_epi32(expo, _mm256_set1_epi32((23 - M) << 23)),
                                         _mm256_set1_epi32(magic_min));
  const __m256i t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(magic)));
  const __m256i hi = _mm256_srli_epi32(_mm256_sub_epi32(magic, _mm256_set1_epi32(magic_min)), 23 - M);
  return _mm256_add_epi32(_mm256_sub_epi32(t, magic), hi);
}

// Values of 8 non-negative finite fp8 codes (avx512.h's fp8_value16).
template <bool E4M3>
PPQ_ALWAYS_INLINE inline __m256 fp8_value8(__m256i c) {
  constexpr int M = E4M3 ? 3 : 2;
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(c, 23 - M), _mm256_set1_epi32((E4M3 ? 120 : 112) << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(E4M3 ? 0x1p-9f : 0x1p-16f));
  const __m256i is_normal = _mm256_cmpgt_epi32(c, _mm256_set1_epi32((1 << M) - 1));
  return _mm256_blendv_ps(sub, _mm256_castsi256_ps(normal), _mm256_castsi256_ps(is_normal));
}

// fp8 codes of 8 values y (scaled): the codes of fp8.h's f32_to_e4m3 / f32_to_e5m2 of y clamped to
// [-Q, Q] (NaN: 0x7f with its sign), one per 32-bit lane (weights.cpp's AVX-512 fp8_codes, 8 lanes).
template <bool E4M3>
PPQ_ALWAYS_INLINE inline __m256i fp8_codes(__m256 y) {
  const __m256 a = _mm256_min_ps(_mm256_set1_ps(E4M3 ? 448.0f : 57344.0f),
                                 _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))));
  __m256i r = fp8_rne8<E4M3>(a);
  r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7f)),
                                           _mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
  return _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 24), _mm256_set1_epi32(0x80)));
}

// Values of 8 fp8 codes (one per 32-bit lane): fp8.h's e4m3_to_f32 / e5m2_to_f32.
template <bool E4M3>
PPQ_ALWAYS_INLINE inline __m256 fp8_decode8(__m256i c) {
  const __m256i m7f = _mm256_set1_epi32(0x7f);
  const __m256i u = _mm256_and_si256(c, m7f);
  __m256i r = _mm256_castps_si256(fp8_value8<E4M3>(u));
  if constexpr (E4M3) {
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(u, m7f));
  } else {
    const __m256i nan = _mm256_and_si256(_mm256_cmpgt_epi32(u, _mm256_set1_epi32(0x7c)), _mm256_set1_epi32(1 << 22));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_set1_epi32(0x7f800000), nan),
                           _mm256_cmpgt_epi32(u, _mm256_set1_epi32(0x7b)));
  }
  return _mm256_castsi256_ps(_mm256_or_si256(r, _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
}

// Low bytes of the 32 lanes of a, b, c, d (8 each), in order: 32 bytes.
PPQ_ALWAYS_INLINE inline __m256i bytes32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ff = _mm256_set1_epi32(0xff);
  const __m256i ab = _mm256_packus_epi32(_mm256_and_si256(a, ff), _mm256_and_si256(b, ff));
  const __m256i cd = _mm256_packus_epi32(_mm256_and_si256(c, ff), _mm256_and_si256(d, ff));
  // lane-wise packs: [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7] as dwords -> restore the order
  return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// Low bytes of the 16 lanes of a, b, in order, for lanes already within a byte's range, 0..255 (SIGNED:
// -128..127): the saturating packs are then exact, so the lanes need no masking (bytes16 below masks).
template <bool SIGNED>
PPQ_ALWAYS_INLINE inline __m128i bytes16_in_range(__m256i a, __m256i b) {
  const __m256i z = _mm256_setzero_si256();
  const __m256i p = SIGNED ? _mm256_packs_epi16(_mm256_packs_epi32(a, b), z)     // dwords: [a0-3, b0-3, 0, 0 |
                           : _mm256_packus_epi16(_mm256_packus_epi32(a, b), z);  //   a4-7, b4-7, 0, 0]
  return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
}
// Low bytes of the 16 lanes of a, b, in order: 16 bytes.
PPQ_ALWAYS_INLINE inline __m128i bytes16(__m256i a, __m256i b) {
  const __m256i ff = _mm256_set1_epi32(0xff);
  return bytes16_in_range<false>(_mm256_and_si256(a, ff), _mm256_and_si256(b, ff));
}
// Low 16 bits of the 16 lanes of a, b, in order.
PPQ_ALWAYS_INLINE inline __m256i words16(__m256i a, __m256i b) {
  const __m256i m = _mm256_set1_epi32(0xffff);
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(a, m), _mm256_and_si256(b, m)), 0xd8);
}

// 8 fp32 -> bf16 bits (round to nearest even; NaN -> 0x7fc0) in the low half of each 32-bit lane.
PPQ_ALWAYS_INLINE inline __m256i bf16_bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)),
                                              _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
PPQ_ALWAYS_INLINE inline void store16(float* o, __m256 a, __m256 b) {
  _mm256_storeu_ps(o, a);
  _mm256_storeu_ps(o + 8, b);
}
PPQ_ALWAYS_INLINE inline void store16(uint16_t* o, __m256 a, __m256 b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), words16(bf16_bits8(a), bf16_bits8(b)));
}

}  // namespace ppq::avx2

#endif  // PPQ_HAS_AVX2
