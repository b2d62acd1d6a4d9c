// Stochastic-rounding quantization of one block of weights (int8 / fp8 e4m3 / fp8 e5m2), shared by
// weights_sr.cpp (ppq::weight_quantize_sr_out) and master_free.cpp (the fused master-free update).
// The design note is weights_sr.cpp's; the math is deepspeed_ppq/quant/sr_ops.py's.
//
// Block-local: every function takes the block's first value, code and random counter
// (counter = the draw's offset + the block's flat index), so a caller may hand over a stack buffer.
// Header-only and inline, compiled into each CPU variant with that variant's flags (isa.h).
#pragma once

#include <c10/util/BFloat16.h>

#include "avx2.h"
#include "avx512.h"
#include "common/formats.h"
#include "fp8.h"
#include "isa.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
#include <immintrin.h>
#endif

namespace ppq::sr {

namespace fp8 = ppq::fp8;

constexpr int64_t kRun = 4096;  // values per run of blocks (quantize_blocks)

// The formats (those with formats::has_sr come here), their Q and fp8 top codes: common/formats.h.
using formats::Fmt;
using formats::qmax;

inline uint32_t hash32(uint32_t x) {  // "lowbias32"
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

inline float load(const void* x, bool bf16, int64_t i) {
  return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(x)[i]) : static_cast<const float*>(x)[i];
}

// Magnitude a in [0, Q] -> stochastic fp8 code with the sign of y. ENC/DEC: the fp8.h conversions.
template <uint8_t (*ENC)(float), float (*DEC)(uint8_t)>
inline uint8_t sr_fp8(float y, float a, float u, int top) {
  const int c = ENC(a);
  const float v = DEC(static_cast<uint8_t>(c));
  const int lo_c = v > a ? c - 1 : c;
  const int hi_c = lo_c >= top ? lo_c : lo_c + 1;
  const float lo = DEC(static_cast<uint8_t>(lo_c));
  const float hi = DEC(static_cast<uint8_t>(hi_c));
  const int q = u * (hi - lo) < a - lo ? hi_c : lo_c;
  return static_cast<uint8_t>(y < 0.0f ? (q | 0x80) : q);
}

#if PPQ_ISA_AVX512
// sr_fp8 for 16 values, codes in the low byte of each 32-bit lane: sr_fp8_8's neighbours by the mantissa
// cut (see below), with mask registers for the selects.
template <bool E4M3>
PPQ_ALWAYS_INLINE inline __m512i sr_fp8_16(__m512 y, __m512 a, __m512 u) {
  constexpr int M = E4M3 ? 3 : 2, bias = E4M3 ? 7 : 15;  // emin = 1 - bias: -6, -14
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i code_n = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23 - M), _mm512_set1_epi32((127 - bias) << M));
  const __m512 lo_n = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(~((1 << (23 - M)) - 1))));
  const __m512 step_n = _mm512_castsi512_ps(
      _mm512_sub_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(M << 23)));
  const __m512 step_s = _mm512_set1_ps(E4M3 ? 0x1p-9f : 0x1p-16f);  // 2^(emin - M)
  const __m512i code_s = _mm512_cvttps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(E4M3 ? 0x1p9f : 0x1p16f)));
  const __m512 lo_s = _mm512_mul_ps(_mm512_cvtepi32_ps(code_s), step_s);
  const __mmask16 sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(E4M3 ? 0x1p-6f : 0x1p-14f), _CMP_LT_OQ);
  const __m512i code = _mm512_mask_blend_epi32(sub, code_n, code_s);
  const __m512 lo = _mm512_mask_blend_ps(sub, lo_n, lo_s), step = _mm512_mask_blend_ps(sub, step_n, step_s);
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, step), _mm512_sub_ps(a, lo), _CMP_LT_OQ);
  const __m512i q = _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
  const __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_or_epi32(q, neg, q, _mm512_set1_epi32(0x80));
}

PPQ_ALWAYS_INLINE inline __m512i hash16(__m512i x) {  // hash32 on 16 lanes
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int32_t(0x7feb352du)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int32_t(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
#endif

#if PPQ_ISA_AVX2
// sr_fp8 for 8 values: y clamped to [-Q, Q], a = |y|, u uniforms; codes in the low byte of each 32-bit
// lane. The neighbours without a code search: lo, the largest fp8 value <= a, is a with its mantissa cut
// to M bits (a >= 2^emin; its code is the cut bits re-biased, the grid step above it 2^(exponent - M)), or
// floor(a / s) s with s = 2^(emin - M) below 2^emin; hi - lo is that step. So u * (hi - lo) < a - lo
// (exact: a power of two times u, and a cut of a) is sr_fp8's test; at a = Q, a - lo = 0 never rounds
// up, as sr_fp8's hi = lo at the top code. About half the operations of sr_fp8's code search.
template <bool E4M3>
PPQ_ALWAYS_INLINE inline __m256i sr_fp8_8(__m256 y, __m256 a, __m256 u) {
  constexpr int M = E4M3 ? 3 : 2, bias = E4M3 ? 7 : 15;  // emin = 1 - bias: -6, -14
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i code_n = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23 - M), _mm256_set1_epi32((127 - bias) << M));
  const __m256 lo_n = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(~((1 << (23 - M)) - 1))));
  const __m256 step_n = _mm256_castsi256_ps(
      _mm256_sub_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000)), _mm256_set1_epi32(M << 23)));
  const __m256 step_s = _mm256_set1_ps(E4M3 ? 0x1p-9f : 0x1p-16f);  // 2^(emin - M)
  const __m256i code_s = _mm256_cvttps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(E4M3 ? 0x1p9f : 0x1p16f)));
  const __m256 lo_s = _mm256_mul_ps(_mm256_cvtepi32_ps(code_s), step_s);
  const __m256 sub = _mm256_cmp_ps(a, _mm256_set1_ps(E4M3 ? 0x1p-6f : 0x1p-14f), _CMP_LT_OQ);
  const __m256i code = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(code_n), _mm256_castsi256_ps(code_s), sub));
  const __m256 lo = _mm256_blendv_ps(lo_n, lo_s, sub), step = _mm256_blendv_ps(step_n, step_s, sub);
  const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(u, step), _mm256_sub_ps(a, lo), _CMP_LT_OQ);
  const __m256i q = _mm256_sub_epi32(code, _mm256_castps_si256(up));
  const __m256 neg = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_or_si256(q, _mm256_and_si256(_mm256_castps_si256(neg), _mm256_set1_epi32(0x80)));
}

PPQ_ALWAYS_INLINE inline __m256i hash8(__m256i x) {  // hash32 on 8 lanes
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int32_t(0x7feb352du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int32_t(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
#endif

// max |x| over len values; *bad: some are NaN/Inf.
inline float block_absmax(const void* x, bool bf16, int64_t len, bool* bad) {
  float m = 0.0f;
  bool b = false;
  int64_t i = 0;
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
  // an integer-bits max over the whole multiple of 16 (NaN/Inf: bits >= 0x7f800000); a scalar max chain
  // here cost as much as the whole encode
  uint32_t mb = 0;
  if (const int64_t n16 = len & ~int64_t(15); n16 > 0) {
#if PPQ_ISA_AVX512
    namespace v = ppq::avx512;
#else
    namespace v = ppq::avx2;
#endif
    mb = bf16 ? v::absmax_bits(static_cast<const uint16_t*>(x), n16) : v::absmax_bits(static_cast<const float*>(x), n16);
    i = n16;
  }
  b = mb >= 0x7f800000u;
  if (!b) std::memcpy(&m, &mb, sizeof(m));
#endif
  for (; i < len; ++i) {
    const float v = load(x, bf16, i);
    b |= !std::isfinite(v);
    m = std::max(m, std::fabs(v));
  }
  *bad = b;
  return m;
}

inline float stored_scale(float absmax, bool bad, float q, bool scale_bf16) {
  float s = bad ? std::numeric_limits<float>::quiet_NaN() : absmax / q;
  if (scale_bf16) s = static_cast<float>(c10::BFloat16(s));
  return s;
}

// Random numbers of counters c0 .. c0 + len - 1 (len <= 4096) into u: a pure 32-bit integer loop. The
// 64-bit counter c0 + j is split as base + j with j < 2^32, so the high word only needs a carry; its
// hash (sr_ops.py: h(key ^ high word)) is one of two values per block.
inline void block_uniforms(uint64_t c0, int64_t len, uint32_t key, float* __restrict u) {
  const uint32_t blo = static_cast<uint32_t>(c0), bhi = static_cast<uint32_t>(c0 >> 32);
  const uint32_t k0 = hash32(key ^ bhi), k1 = hash32(key ^ (bhi + 1u));
  for (uint32_t j = 0; j < static_cast<uint32_t>(len); ++j) {
    const uint32_t lo = blo + j;
    const uint32_t r = hash32(lo ^ (lo < blo ? k1 : k0));
    u[j] = static_cast<float>(static_cast<int32_t>(r >> 8)) * 5.9604644775390625e-08f;  // 2^-24
  }
}

// int8 codes of one block from fp32 values and their uniforms. GCC left the plain loop scalar with a
// branch on the sign (random: half mispredicted), ~7 ns per value; AVX-512 runs 16 at a time.
inline void encode_int8(const float* __restrict xf, const float* __restrict u, int8_t* __restrict out, int64_t len,
                        float inv, float q) {
  int64_t j = 0;
#if PPQ_ISA_AVX512
  {
    const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-q), hi = _mm512_set1_ps(q);
    const __m512i one = _mm512_set1_epi32(1);
    for (; j + 16 <= len; j += 16) {
      const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(xf + j), vinv), lo), hi);
      const __m512 a = _mm512_abs_ps(y);
      const __m512i l = _mm512_cvttps_epi32(a);  // truncation = floor for a >= 0
      const __m512 frac = _mm512_sub_ps(a, _mm512_cvtepi32_ps(l));
      __m512i k = _mm512_mask_add_epi32(l, _mm512_cmp_ps_mask(_mm512_loadu_ps(u + j), frac, _CMP_LT_OQ), l, one);
      k = _mm512_mask_sub_epi32(k, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_si512(), k);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(k));
    }
  }
#endif
  for (; j < len; ++j) {
    const float y = std::min(std::max(xf[j] * inv, -q), q);
    const float a = std::fabs(y);
    const int32_t lo = static_cast<int32_t>(a);  // truncation = floor for a >= 0
    const int32_t k = lo + static_cast<int32_t>(u[j] < a - static_cast<float>(lo));
    out[j] = static_cast<int8_t>(y < 0.0f ? -k : k);
  }
}

// The block in two passes: the random numbers first (a pure integer loop), then the codes; bf16 input
// widened into a stack buffer first. The scalar module's path, AVX-512's, and the tails of AVX2's.
template <Fmt F, bool BF16>
__attribute__((noinline)) void encode_buffered(const void* x, int64_t len, float inv, uint64_t c0, uint32_t key,
                                               uint8_t* codes) {
  alignas(64) float u[4096];
  alignas(64) float wide[4096];
  block_uniforms(c0, len, key, u);
  const float* xf = static_cast<const float*>(x);
  if constexpr (BF16) {
    const c10::BFloat16* xb = static_cast<const c10::BFloat16*>(x);
    for (int64_t j = 0; j < len; ++j) wide[j] = static_cast<float>(xb[j]);
    xf = wide;
  }
  if constexpr (F == Fmt::I8) {
    encode_int8(xf, u, reinterpret_cast<int8_t*>(codes), len, inv, 127.0f);
  } else {
    const float q = qmax(F);
    int64_t j = 0;
#if PPQ_ISA_AVX512
    {  // the loop below, 16 at a time
      const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-q), hi = _mm512_set1_ps(q);
      for (; j + 16 <= len; j += 16) {
        const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(xf + j), vinv), lo), hi);
        const __m512i c = sr_fp8_16<F == Fmt::E4M3>(y, _mm512_abs_ps(y), _mm512_loadu_ps(u + j));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtepi32_epi8(c));
      }
    }
#endif
    for (; j < len; ++j) {
      const float y = std::min(std::max(xf[j] * inv, -q), q);
      const float a = std::fabs(y);
      codes[j] = F == Fmt::E4M3 ? sr_fp8<fp8::f32_to_e4m3, fp8::e4m3_to_f32>(y, a, u[j], formats::max_code(F))
                                : sr_fp8<fp8::f32_to_e5m2, fp8::e5m2_to_f32>(y, a, u[j], formats::max_code(F));
    }
  }
}

#if PPQ_ISA_AVX2
// The AVX2 path, fused: the random numbers are made in-register next to the codes (no buffer pass), input
// read straight from fp32 or bf16, 16 values per iteration (two 8-lane chains; four spilled registers:
// AVX2 has 16). The values at j are multiplied by inv[j >> lg]: one block (lg >= log2 len) or a run of
// blocks of 2^lg >= 16 values in one loop (a block of 64 values had cost as much in set-up as in codes).
// CARRY: the counters cross a multiple of 2^32, so the high word needs the carry (one run in 2^32 / 4096
// at most); otherwise the high word is c0's. Handles the first multiple of 16 values and returns how
// many; encode_buffered() does the rest.
// PREFETCH: x is a kRun-value run read from memory (not a buffer in cache): the same place in the next
// run is prefetched while this one is encoded, so the next run's absmax pass reads from cache and the
// memory works under the encode instead of before it.
template <Fmt F, bool BF16, bool CARRY, bool PREFETCH>
PPQ_ALWAYS_INLINE inline int64_t encode_fused_avx2(const void* x, int64_t len, const float* inv, int lg, uint64_t c0,
                                                   uint32_t key, uint8_t* codes) {
  using T = std::conditional_t<BF16, uint16_t, float>;
  const int64_t n16 = len & ~int64_t(15);
  const uint32_t bhi = uint32_t(c0 >> 32);
  const __m256i vblo = _mm256_set1_epi32(int32_t(uint32_t(c0))), bias = _mm256_set1_epi32(int32_t(0x80000000u));
  const __m256i k0 = _mm256_set1_epi32(int32_t(hash32(key ^ bhi))), k1 = _mm256_set1_epi32(int32_t(hash32(key ^ (bhi + 1u))));
  auto uniforms8 = [&](__m256i lo) PPQ_ALWAYS_INLINE {  // lo: the 8 counters' low words
    __m256i k = k0;
    if constexpr (CARRY) {  // lo < blo (unsigned): the counter wrapped into the next 2^32
      k = _mm256_blendv_epi8(k0, k1, _mm256_cmpgt_epi32(_mm256_xor_si256(vblo, bias), _mm256_xor_si256(lo, bias)));
    }
    const __m256i r = hash8(_mm256_xor_si256(lo, k));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), _mm256_set1_ps(5.9604644775390625e-08f));
  };
  const T* xp = static_cast<const T*>(x);
  const float q = qmax(F);
  const __m256 neg_q = _mm256_set1_ps(-q), pos_q = _mm256_set1_ps(q);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto code8 = [&](int64_t i, __m256i ctr, __m256 vinv) PPQ_ALWAYS_INLINE {
    const __m256 z = _mm256_mul_ps(ppq::avx2::load8(xp + i), vinv);
    const __m256 u = uniforms8(ctr);
    if constexpr (F == Fmt::I8) {  // encode_int8's lanes
      const __m256 a = _mm256_min_ps(_mm256_and_ps(z, abs_mask), pos_q);  // |clamp(z, -q, q)| (z is finite or +-inf)
      const __m256i l = _mm256_cvttps_epi32(a);
      const __m256 frac = _mm256_sub_ps(a, _mm256_cvtepi32_ps(l));
      const __m256i k = _mm256_sub_epi32(l, _mm256_castps_si256(_mm256_cmp_ps(u, frac, _CMP_LT_OQ)));
      return _mm256_sign_epi32(k, _mm256_castps_si256(z));  // sign bit set: -k (k = 0 when z = -0.0)
    } else {
      const __m256 y = _mm256_min_ps(_mm256_max_ps(z, neg_q), pos_q);
      return sr_fp8_8<F == Fmt::E4M3>(y, _mm256_and_ps(y, abs_mask), u);
    }
  };
  // the counters' low words run in a register: blo + j + lane
  __m256i ctr = _mm256_add_epi32(vblo, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t j = 0; j < n16; j += 16) {
    if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(xp + kRun + j), _MM_HINT_T0);  // 64 B
    const __m256i next = _mm256_add_epi32(ctr, eight);
    const __m256 vinv = _mm256_broadcast_ss(inv + (j >> lg));
    // int8 codes lie in [-127, 127], fp8 codes in [0, 255] (finite input: no NaN code)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j),
                     ppq::avx2::bytes16_in_range<F == Fmt::I8>(code8(j, ctr, vinv), code8(j + 8, next, vinv)));
    ctr = _mm256_add_epi32(next, eight);
  }
  return n16;
}
#endif

#if PPQ_ISA_AVX512
// encode_fused_avx2 on 16 lanes, two chains per iteration (32 values): the counters' hash, the uniforms and
// the codes in registers, fp32 or bf16 read straight, each chain's inverse scale inv[j >> lg] (2^lg >= 16).
// Handles the first multiple of 16 values and returns how many; encode_buffered() does the rest.
template <Fmt F, bool BF16, bool CARRY, bool PREFETCH>
PPQ_ALWAYS_INLINE inline int64_t encode_fused_avx512(const void* x, int64_t len, const float* inv, int lg, uint64_t c0,
                                                     uint32_t key, uint8_t* codes) {
  using T = std::conditional_t<BF16, uint16_t, float>;
  const int64_t n16 = len & ~int64_t(15);
  const uint32_t bhi = uint32_t(c0 >> 32);
  const __m512i vblo = _mm512_set1_epi32(int32_t(uint32_t(c0)));
  const __m512i k0 = _mm512_set1_epi32(int32_t(hash32(key ^ bhi))), k1 = _mm512_set1_epi32(int32_t(hash32(key ^ (bhi + 1u))));
  auto uniforms16 = [&](__m512i lo) PPQ_ALWAYS_INLINE {  // lo: the 16 counters' low words
    __m512i k = k0;
    if constexpr (CARRY) k = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(lo, vblo), k0, k1);  // wrapped
    const __m512i r = hash16(_mm512_xor_si512(lo, k));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(r, 8)), _mm512_set1_ps(5.9604644775390625e-08f));
  };
  const T* xp = static_cast<const T*>(x);
  const float q = qmax(F);
  const __m512 neg_q = _mm512_set1_ps(-q), pos_q = _mm512_set1_ps(q);
  auto code16 = [&](int64_t i, __m512i ctr) PPQ_ALWAYS_INLINE {
    if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(xp + kRun + i), _MM_HINT_T0);
    const __m512 z = _mm512_mul_ps(ppq::avx512::load16(xp + i), _mm512_set1_ps(inv[i >> lg]));
    const __m512 u = uniforms16(ctr);
    if constexpr (F == Fmt::I8) {  // encode_int8's lanes
      const __m512 a = _mm512_min_ps(_mm512_abs_ps(z), pos_q);  // |clamp(z, -q, q)| (z is finite or +-inf)
      const __m512i l = _mm512_cvttps_epi32(a);
      const __m512 frac = _mm512_sub_ps(a, _mm512_cvtepi32_ps(l));
      const __m512i k = _mm512_mask_add_epi32(l, _mm512_cmp_ps_mask(u, frac, _CMP_LT_OQ), l, _mm512_set1_epi32(1));
      // sign bit set: -k (k = 0 when z = -0.0)
      return _mm512_mask_sub_epi32(k, _mm512_movepi32_mask(_mm512_castps_si512(z)), _mm512_setzero_si512(), k);
    } else {
      const __m512 y = _mm512_min_ps(_mm512_max_ps(z, neg_q), pos_q);
      return sr_fp8_16<F == Fmt::E4M3>(y, _mm512_abs_ps(y), u);
    }
  };
  // the counters' low words run in a register: blo + j + lane
  __m512i ctr = _mm512_add_epi32(vblo, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i sixteen = _mm512_set1_epi32(16);
  int64_t j = 0;
  for (; j + 32 <= n16; j += 32) {
    const __m512i next = _mm512_add_epi32(ctr, sixteen);
    const __m512i a = code16(j, ctr), b = code16(j + 16, next);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtepi32_epi8(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j + 16), _mm512_cvtepi32_epi8(b));
    ctr = _mm512_add_epi32(next, sixteen);
  }
  if (j < n16) _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtepi32_epi8(code16(j, ctr)));
  return n16;
}
#endif

// Codes of one block x[0 .. len) with inverse scale inv (finite: the block had no NaN/Inf).
template <Fmt F, bool BF16>
inline void encode_t(const void* x, int64_t len, float inv, bool finite, uint64_t c0, uint32_t key, uint8_t* codes) {
  if (!finite) {  // a block with NaN/Inf: zero codes (the NaN scale marks it)
    std::memset(codes, 0, static_cast<size_t>(len));
    return;
  }
  int64_t done = 0;
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
  const bool carry = static_cast<uint64_t>(static_cast<uint32_t>(c0)) + static_cast<uint64_t>(len) > 0xffffffffull;
  constexpr int lg = 62;  // j >> 62 is 0 for every j: inv alone, for the whole block
#if PPQ_ISA_AVX512
  done = carry ? encode_fused_avx512<F, BF16, true, false>(x, len, &inv, lg, c0, key, codes)
               : encode_fused_avx512<F, BF16, false, false>(x, len, &inv, lg, c0, key, codes);
#else
  done = carry ? encode_fused_avx2<F, BF16, true, false>(x, len, &inv, lg, c0, key, codes)
               : encode_fused_avx2<F, BF16, false, false>(x, len, &inv, lg, c0, key, codes);
#endif
#endif
  if (done < len) {
    using T = std::conditional_t<BF16, uint16_t, float>;
    encode_buffered<F, BF16>(static_cast<const T*>(x) + done, len - done, inv, c0 + static_cast<uint64_t>(done),
                             key, codes + done);
  }
}

// inv = min(1 / s, FLT_MAX), 0 when s == 0 (sr_ops.py).
inline float inverse_scale(float s) {
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  return std::min(inv, std::numeric_limits<float>::max());
}

template <bool BF16>
inline void encode(Fmt f, const void* x, int64_t len, float s, uint64_t c0, uint32_t key, uint8_t* codes) {
  const bool finite = std::isfinite(s);
  const float inv = inverse_scale(s);
  switch (f) {
    case Fmt::I8: encode_t<Fmt::I8, BF16>(x, len, inv, finite, c0, key, codes); break;
    case Fmt::E4M3: encode_t<Fmt::E4M3, BF16>(x, len, inv, finite, c0, key, codes); break;
    default: encode_t<Fmt::E5M2, BF16>(x, len, inv, finite, c0, key, codes); break;
  }
}

// The blocks of B values in x[0 .. len) (len <= kRun; the last block may be short), each with its own
// scale (stored into s[0 .. ceil(len / B))): every block's absmax and scale first, then the codes. Apart,
// the scales are short independent chains (a reduction, two divisions) the core runs side by side; inside
// each block's encode they had stood between two blocks' loops (a third of the time at B = 64). With
// AVX2 or AVX-512 and every block finite, the codes are one loop over the run (encode_fused_avx2 / _avx512).
template <Fmt F, bool BF16, bool PREFETCH>
inline void quantize_blocks_t(const void* x, int64_t len, int64_t B, bool scale_bf16, uint64_t c0, uint32_t key,
                              uint8_t* codes, float* s) {
  using T = std::conditional_t<BF16, uint16_t, float>;
  const T* xp = static_cast<const T*>(x);
  const int64_t nb = (len + B - 1) / B;
  float inv[kRun / 16];
  bool finite = true;
  for (int64_t b = 0; b < nb; ++b) {
    bool bad = false;
    const float absmax = block_absmax(xp + b * B, BF16, std::min(B, len - b * B), &bad);  // sets bad
    s[b] = stored_scale(absmax, bad, qmax(F), scale_bf16);
    inv[b] = inverse_scale(s[b]);
    finite = finite && !bad;
  }
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
  if (finite) {
    const int lg = std::countr_zero(static_cast<uint64_t>(B));
    const bool carry = static_cast<uint64_t>(static_cast<uint32_t>(c0)) + static_cast<uint64_t>(len) > 0xffffffffull;
#if PPQ_ISA_AVX512
    const int64_t done = carry ? encode_fused_avx512<F, BF16, true, PREFETCH>(xp, len, inv, lg, c0, key, codes)
                               : encode_fused_avx512<F, BF16, false, PREFETCH>(xp, len, inv, lg, c0, key, codes);
#else
    const int64_t done = carry ? encode_fused_avx2<F, BF16, true, PREFETCH>(xp, len, inv, lg, c0, key, codes)
                               : encode_fused_avx2<F, BF16, false, PREFETCH>(xp, len, inv, lg, c0, key, codes);
#endif
    if (done < len)  // fewer than 16 values, inside the last block
      encode_buffered<F, BF16>(xp + done, len - done, inv[done >> lg], c0 + static_cast<uint64_t>(done), key, codes + done);
    return;
  }
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * B;
    encode_t<F, BF16>(xp + o, std::min(B, len - o), inv[b], std::isfinite(s[b]), c0 + static_cast<uint64_t>(o), key,
                      codes + o);
  }
}

// The nb scales of a run into the op's scales tensor (fp32, or bf16 when sbf) from block `first` on.
inline void store_scales(void* scales, bool sbf, int64_t first, const float* s, int64_t nb) {
  if (sbf) {
    auto* o = static_cast<c10::BFloat16*>(scales) + first;
    for (int64_t b = 0; b < nb; ++b) o[b] = c10::BFloat16(s[b]);
  } else {
    std::memcpy(static_cast<float*>(scales) + first, s, static_cast<size_t>(nb) * sizeof(float));
  }
}

template <bool BF16>
inline void quantize_blocks(Fmt f, const void* x, int64_t len, int64_t B, bool scale_bf16, uint64_t c0, uint32_t key,
                            uint8_t* codes, float* s) {
  switch (f) {
    case Fmt::I8: quantize_blocks_t<Fmt::I8, BF16, true>(x, len, B, scale_bf16, c0, key, codes, s); break;
    case Fmt::E4M3: quantize_blocks_t<Fmt::E4M3, BF16, true>(x, len, B, scale_bf16, c0, key, codes, s); break;
    default: quantize_blocks_t<Fmt::E5M2, BF16, true>(x, len, B, scale_bf16, c0, key, codes, s); break;
  }
}

}  // namespace ppq::sr
