// Stochastic-rounding blockwise quantization of weights to int8 / fp8 e4m3 / fp8 e5m2 on CPU.
//
// Design note.
// * The math is the one written in deepspeed_ppq/quant/sr_ops.py, bit for bit given the same (seed,
//   offset): scales as the deterministic weight quantizer (absmax / Q rounded to fp32 or bf16, or one
//   scale for the whole tensor), a counter-based hash per element for the random bits (no generator
//   state: element i uses counter offset + i, so blocks run in any order on any thread), and the
//   round-up test u * (hi - lo) < a - lo on the magnitude, exact in fp32.
// * Used once per optimizer step per master-free layer (dequantize -> update -> this), so it is a
//   single pass per block: absmax over the block (L1-resident after the first read), scale, encode.
//   Blocks are independent; OpenMP splits them statically. A per-tensor fp8 scale needs the global
//   absmax first (one extra read pass). Per block, the random numbers are made first in a pure 32-bit
//   integer loop into a stack buffer (the 64-bit counter is a block base plus a carry), then one loop per
//   (format, input dtype) encodes.
// * With AVX-512 the absmax and the encodes run 16 values at a time in explicit loops, with AVX2 8 at a
//   time (isa.h picks per module; the scalar loops stay for block tails and the scalar module). GCC had left them scalar, with a branch on the random
//   sign: ~7 ns per value for int8 and ~20 for fp8, now ~0.4 and ~0.6 on one core. The absmax, the fp8
//   round-to-nearest-even code and the neighbours' values come from avx512.h, shared with weights.cpp;
//   tests/test_master_free.py holds every path to the reference bit for bit.
// * fp8 neighbours come from the round-to-nearest-even code (c10's own fp32 -> fp8 recipe, the one
//   torch's cast uses, in its branch-free form shared through fp8.h) and the code one below or above
//   it: fp8 codes of one sign order like their magnitudes.
// * A block holding NaN/Inf gets a NaN scale and zero codes; the Python front end raises.
// * Kept apart from weights.cpp (another concern's file); the scalar helpers repeat on purpose, the
//   AVX-512 ones are shared through avx512.h.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include "avx2.h"
#include "avx512.h"
#include "fp8.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
#include <immintrin.h>
// GCC 12's false positive on the intrinsics' _mm512_undefined_*() placeholders (see weights.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

namespace fp8 = ppq::fp8;

enum class SrFmt { I8, E4M3, E5M2 };

SrFmt parse_sr_fmt(std::string_view f) {
  if (f == "int8") return SrFmt::I8;
  if (f == "fp8_e4m3") return SrFmt::E4M3;
  if (f == "fp8_e5m2") return SrFmt::E5M2;
  TORCH_CHECK(false, "fmt='", std::string(f),
              "' has no stochastic-rounding quantizer: use int8, fp8_e4m3 or fp8_e5m2");
}

float sr_qmax(SrFmt f) { return f == SrFmt::I8 ? 127.0f : f == SrFmt::E4M3 ? 448.0f : 57344.0f; }

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
using ppq::avx512::fp8_rne16;
using ppq::avx512::fp8_value16;

// sr_fp8 for 16 values: y clamped to [-Q, Q], a = |y|, u uniforms.
template <bool E4M3>
inline __m128i sr_fp8_16(__m512 y, __m512 a, __m512 u) {
  const __m512i top = _mm512_set1_epi32(E4M3 ? 0x7E : 0x7B), one = _mm512_set1_epi32(1);
  const __m512i c = fp8_rne16<E4M3>(a);
  const __m512i lo_c = _mm512_mask_sub_epi32(c, _mm512_cmp_ps_mask(fp8_value16<E4M3>(c), a, _CMP_GT_OQ), c, one);
  const __m512i hi_c = _mm512_min_epi32(_mm512_add_epi32(lo_c, one), top);
  const __m512 lo = fp8_value16<E4M3>(lo_c), hi = fp8_value16<E4M3>(hi_c);
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, _mm512_sub_ps(hi, lo)), _mm512_sub_ps(a, lo), _CMP_LT_OQ);
  __m512i q = _mm512_mask_blend_epi32(up, lo_c, hi_c);
  q = _mm512_mask_or_epi32(q, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), q, _mm512_set1_epi32(0x80));
  return _mm512_cvtepi32_epi8(q);
}
#endif

#if PPQ_ISA_AVX2
using ppq::avx2::fp8_rne8;
using ppq::avx2::fp8_value8;

// sr_fp8 for 8 values (the AVX-512 sr_fp8_16 on 8 lanes): codes in the low byte of each 32-bit lane.
template <bool E4M3>
inline __m256i sr_fp8_8(__m256 y, __m256 a, __m256 u) {
  const __m256i top = _mm256_set1_epi32(E4M3 ? 0x7E : 0x7B), one = _mm256_set1_epi32(1);
  const __m256i c = fp8_rne8<E4M3>(a);
  const __m256i lo_c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(fp8_value8<E4M3>(c), a, _CMP_GT_OQ)));
  const __m256i hi_c = _mm256_min_epi32(_mm256_add_epi32(lo_c, one), top);
  const __m256 lo = fp8_value8<E4M3>(lo_c), hi = fp8_value8<E4M3>(hi_c);
  const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(u, _mm256_sub_ps(hi, lo)), _mm256_sub_ps(a, lo), _CMP_LT_OQ);
  const __m256i q = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lo_c), _mm256_castsi256_ps(hi_c), up));
  const __m256 neg = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_or_si256(q, _mm256_and_si256(_mm256_castps_si256(neg), _mm256_set1_epi32(0x80)));
}
#endif

float block_absmax(const void* x, bool bf16, int64_t i0, int64_t i1, bool* bad) {
  float m = 0.0f;
  bool b = false;
#if PPQ_ISA_AVX512
  // avx512.h's integer-bits max over the whole multiple of 16 (NaN/Inf: bits >= 0x7f800000); a scalar
  // max chain here cost as much as the whole encode.
  uint32_t mb = 0;
  if (const int64_t n16 = (i1 - i0) & ~int64_t(15); n16 > 0) {
    mb = bf16 ? ppq::avx512::absmax_bits(static_cast<const uint16_t*>(x) + i0, n16)
              : ppq::avx512::absmax_bits(static_cast<const float*>(x) + i0, n16);
    i0 += n16;
  }
  b = mb >= 0x7f800000u;
  if (!b) std::memcpy(&m, &mb, sizeof(m));
#elif PPQ_ISA_AVX2
  uint32_t mb = 0;  // the same with avx2.h's absmax
  if (const int64_t n16 = (i1 - i0) & ~int64_t(15); n16 > 0) {
    mb = bf16 ? ppq::avx2::absmax_bits(static_cast<const uint16_t*>(x) + i0, n16)
              : ppq::avx2::absmax_bits(static_cast<const float*>(x) + i0, n16);
    i0 += n16;
  }
  b = mb >= 0x7f800000u;
  if (!b) std::memcpy(&m, &mb, sizeof(m));
#endif
  for (int64_t i = i0; i < i1; ++i) {
    const float v = load(x, bf16, i);
    b |= !std::isfinite(v);
    m = std::max(m, std::fabs(v));
  }
  *bad = b;
  return m;
}

float stored_scale(float absmax, bool bad, float qmax, bool scale_bf16) {
  float s = bad ? std::numeric_limits<float>::quiet_NaN() : absmax / qmax;
  if (scale_bf16) s = static_cast<float>(c10::BFloat16(s));
  return s;
}

// Random numbers for elements [i0, i1) (at most one block, <= 4096) into u: a pure 32-bit integer loop.
// The 64-bit counter offset + i is split as base + j with j < 2^32, so the high word only needs a carry.
void block_uniforms(int64_t i0, int64_t i1, uint64_t offset, uint32_t key, float* __restrict u) {
  const uint64_t base = offset + static_cast<uint64_t>(i0);
  const uint32_t blo = static_cast<uint32_t>(base), bhi = static_cast<uint32_t>(base >> 32);
  const uint32_t len = static_cast<uint32_t>(i1 - i0);
  for (uint32_t j = 0; j < len; ++j) {
    const uint32_t lo = blo + j;
    const uint32_t hi = bhi + (lo < blo ? 1u : 0u);
    const uint32_t r = hash32(hash32(lo ^ key) ^ hi);
    u[j] = static_cast<float>(static_cast<int32_t>(r >> 8)) * 5.9604644775390625e-08f;  // 2^-24
  }
}

// int8 codes of one block from fp32 values. With AVX-512, 16 at a time; GCC left the plain loop scalar
// with a branch on the sign (random: half mispredicted), ~7 ns per value.
void encode_int8(const float* __restrict xf, const float* __restrict u, int8_t* __restrict out, int64_t len,
                 float inv, float qmax) {
  int64_t j = 0;
#if PPQ_ISA_AVX512
  {
    const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-qmax), hi = _mm512_set1_ps(qmax);
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
#elif PPQ_ISA_AVX2
  {  // 16 at a time, 8 lanes
    const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    auto code8 = [&](int64_t i) PPQ_ALWAYS_INLINE {
      const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(xf + i), vinv), lo), hi);
      const __m256 a = _mm256_and_ps(y, abs_mask);
      const __m256i l = _mm256_cvttps_epi32(a);  // truncation = floor for a >= 0
      const __m256 frac = _mm256_sub_ps(a, _mm256_cvtepi32_ps(l));
      const __m256i k = _mm256_sub_epi32(l, _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(u + i), frac, _CMP_LT_OQ)));
      const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ));
      return _mm256_sub_epi32(_mm256_xor_si256(k, neg), neg);  // y < 0: -k
    };
    for (; j + 16 <= len; j += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), ppq::avx2::bytes16(code8(j), code8(j + 8)));
  }
#endif
  for (; j < len; ++j) {
    const float y = std::min(std::max(xf[j] * inv, -qmax), qmax);
    const float a = std::fabs(y);
    const int32_t lo = static_cast<int32_t>(a);  // truncation = floor for a >= 0
    const int32_t k = lo + static_cast<int32_t>(u[j] < a - static_cast<float>(lo));
    out[j] = static_cast<int8_t>(y < 0.0f ? -k : k);
  }
}

#if PPQ_ISA_AVX2
// The AVX2 path of one block, fused: the random numbers are made in-register next to the codes (no
// buffer pass), input read straight from fp32 or bf16. Handles the first multiple of 16 values of
// [i0, i1) and returns how many; encode_t() does the rest. Same bits as block_uniforms() + the loops.
inline __m256i hash8(__m256i x) {  // hash32 on 8 lanes
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int32_t(0x7feb352du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int32_t(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

template <SrFmt F, bool BF16>
int64_t encode_fused_avx2(const void* x, int64_t i0, int64_t i1, float inv, uint64_t offset, uint32_t key,
                          uint8_t* codes) {
  using T = std::conditional_t<BF16, uint16_t, float>;
  const int64_t n16 = (i1 - i0) & ~int64_t(15);
  const uint64_t base = offset + static_cast<uint64_t>(i0);
  const __m256i vblo = _mm256_set1_epi32(int32_t(uint32_t(base))), vbhi = _mm256_set1_epi32(int32_t(uint32_t(base >> 32)));
  const __m256i vkey = _mm256_set1_epi32(int32_t(key)), bias = _mm256_set1_epi32(int32_t(0x80000000u));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto uniforms8 = [&](int64_t j) PPQ_ALWAYS_INLINE {
    const __m256i lo = _mm256_add_epi32(vblo, _mm256_add_epi32(_mm256_set1_epi32(int32_t(j)), lane));
    const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(vblo, bias), _mm256_xor_si256(lo, bias));  // lo < blo
    const __m256i r = hash8(_mm256_xor_si256(hash8(_mm256_xor_si256(lo, vkey)), _mm256_sub_epi32(vbhi, carry)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), _mm256_set1_ps(5.9604644775390625e-08f));
  };
  const T* xp = static_cast<const T*>(x) + i0;
  const float qmax = sr_qmax(F);
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto code8 = [&](int64_t i) PPQ_ALWAYS_INLINE {
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(ppq::avx2::load8(xp + i), vinv), lo), hi);
    const __m256 a = _mm256_and_ps(y, abs_mask);
    const __m256 u = uniforms8(i);
    if constexpr (F == SrFmt::I8) {  // encode_int8's lanes
      const __m256i l = _mm256_cvttps_epi32(a);
      const __m256 frac = _mm256_sub_ps(a, _mm256_cvtepi32_ps(l));
      const __m256i k = _mm256_sub_epi32(l, _mm256_castps_si256(_mm256_cmp_ps(u, frac, _CMP_LT_OQ)));
      const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ));
      return _mm256_sub_epi32(_mm256_xor_si256(k, neg), neg);
    } else {
      return sr_fp8_8<F == SrFmt::E4M3>(y, a, u);
    }
  };
  for (int64_t j = 0; j < n16; j += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i0 + j), ppq::avx2::bytes16(code8(j), code8(j + 8)));
  return n16;
}
#endif

// One block: random numbers first (a pure integer loop), then the codes. bf16 input is widened into a
// stack buffer first, so the int8 encode loop is the same for both input dtypes.
template <SrFmt F, bool BF16>
void encode_t(const void* x, int64_t i0, int64_t i1, float inv, bool finite, uint64_t offset, uint32_t key,
              uint8_t* codes) {
  const int64_t len = i1 - i0;
  if (!finite) {  // a block with NaN/Inf: zero codes (the NaN scale marks it)
    std::memset(codes + i0, 0, static_cast<size_t>(len));
    return;
  }
#if PPQ_ISA_AVX2
  if (const int64_t done = encode_fused_avx2<F, BF16>(x, i0, i1, inv, offset, key, codes); done > 0) {
    if (done < len) encode_t<F, BF16>(x, i0 + done, i1, inv, finite, offset, key, codes);  // the < 16 left
    return;
  }
#endif
  alignas(64) float u[4096];
  alignas(64) float wide[4096];
  block_uniforms(i0, i1, offset, key, u);
  const float* xf = static_cast<const float*>(x) + i0;
  if constexpr (BF16) {
    const c10::BFloat16* xb = static_cast<const c10::BFloat16*>(x) + i0;
    for (int64_t j = 0; j < len; ++j) wide[j] = static_cast<float>(xb[j]);
    xf = wide;
  }
  if constexpr (F == SrFmt::I8) {
    encode_int8(xf, u, reinterpret_cast<int8_t*>(codes) + i0, len, inv, 127.0f);
  } else {
    const float qmax = sr_qmax(F);
    int64_t j = 0;
#if PPQ_ISA_AVX512
    {  // the loop below, 16 at a time
      const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-qmax), hi = _mm512_set1_ps(qmax);
      for (; j + 16 <= len; j += 16) {
        const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(xf + j), vinv), lo), hi);
        const __m128i q = sr_fp8_16<F == SrFmt::E4M3>(y, _mm512_abs_ps(y), _mm512_loadu_ps(u + j));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i0 + j), q);
      }
    }
#elif PPQ_ISA_AVX2
    {
      const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      auto code8 = [&](int64_t i) PPQ_ALWAYS_INLINE {
        const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(xf + i), vinv), lo), hi);
        return sr_fp8_8<F == SrFmt::E4M3>(y, _mm256_and_ps(y, abs_mask), _mm256_loadu_ps(u + i));
      };
      for (; j + 16 <= len; j += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i0 + j), ppq::avx2::bytes16(code8(j), code8(j + 8)));
    }
#endif
    for (; j < len; ++j) {
      const float y = std::min(std::max(xf[j] * inv, -qmax), qmax);
      const float a = std::fabs(y);
      codes[i0 + j] = F == SrFmt::E4M3 ? sr_fp8<fp8::f32_to_e4m3, fp8::e4m3_to_f32>(y, a, u[j], 0x7E)
                                       : sr_fp8<fp8::f32_to_e5m2, fp8::e5m2_to_f32>(y, a, u[j], 0x7B);
    }
  }
}

template <bool BF16>
void encode_fmt(SrFmt f, const void* x, int64_t i0, int64_t i1, float inv, bool finite, uint64_t offset,
                uint32_t key, uint8_t* codes) {
  switch (f) {
    case SrFmt::I8: encode_t<SrFmt::I8, BF16>(x, i0, i1, inv, finite, offset, key, codes); break;
    case SrFmt::E4M3: encode_t<SrFmt::E4M3, BF16>(x, i0, i1, inv, finite, offset, key, codes); break;
    default: encode_t<SrFmt::E5M2, BF16>(x, i0, i1, inv, finite, offset, key, codes); break;
  }
}

void encode(const void* x, bool bf16, int64_t i0, int64_t i1, float s, SrFmt f, uint64_t offset, uint32_t key,
            uint8_t* codes) {
  const bool finite = std::isfinite(s);
  float inv = s > 0.0f ? 1.0f / s : 0.0f;
  inv = std::min(inv, std::numeric_limits<float>::max());
  if (bf16) encode_fmt<true>(f, x, i0, i1, inv, finite, offset, key, codes);
  else encode_fmt<false>(f, x, i0, i1, inv, finite, offset, key, codes);
}

inline int threads() { return std::max(1, at::get_num_threads()); }

at::ScalarType sr_code_type(SrFmt f) {
  return f == SrFmt::I8 ? at::kChar : f == SrFmt::E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

void weight_quantize_sr_out(const at::Tensor& x, c10::string_view fmt, int64_t B, int64_t seed, int64_t offset,
                            at::Tensor& codes, at::Tensor& scales) {
  const SrFmt f = parse_sr_fmt(fmt);
  TORCH_CHECK(B >= 16 && B <= 4096 && (B & (B - 1)) == 0, "block_size=", B,
              " is not allowed: use a power of two in [16, 4096]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x has dtype ",
              x.scalar_type(), "; allowed: Float (fp32) or BFloat16");
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(seed >= 0 && seed <= 0xffffffffLL, "seed=", seed, " is not allowed: use [0, 2^32)");
  TORCH_CHECK(offset >= 0, "offset=", offset, " is not allowed: use a non-negative counter");
  const int64_t n = x.numel();
  TORCH_CHECK(n > 0, "x is empty");
  const int64_t nb = (n + B - 1) / B;
  TORCH_CHECK(codes.scalar_type() == sr_code_type(f) && codes.is_contiguous() && codes.numel() == n,
              "codes must be a contiguous ", sr_code_type(f), " tensor of ", n, " elements, got ",
              codes.scalar_type(), " with ", codes.numel());
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16,
              "scales has dtype ", scales.scalar_type(), "; allowed: Float or BFloat16");
  const bool per_tensor = scales.numel() == 1 && nb > 1;
  TORCH_CHECK(scales.is_contiguous() && (scales.numel() == nb || (per_tensor && f != SrFmt::I8)),
              "scales has ", scales.numel(), " elements; ", n, " values in blocks of ", B, " need ", nb,
              f != SrFmt::I8 ? " (or 1 for a per-tensor fp8 scale)" : "");
  const bool xbf = x.scalar_type() == at::kBFloat16;
  const bool sbf = scales.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  auto* cp = static_cast<uint8_t*>(codes.data_ptr());
  const uint32_t key = hash32(static_cast<uint32_t>(seed));
  const uint64_t off = static_cast<uint64_t>(offset);
  const float qmax = sr_qmax(f);
  auto put_scale = [&](int64_t j, float s) {
    if (sbf) static_cast<c10::BFloat16*>(scales.data_ptr())[j] = c10::BFloat16(s);
    else static_cast<float*>(scales.data_ptr())[j] = s;
  };
  const bool par = n > (1 << 15);  // small tensors stay on one thread
  if (per_tensor) {
    bool bad = false;
    float m = 0.0f;
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(static) reduction(max : m) reduction(|| : bad)
    for (int64_t b = 0; b < nb; ++b) {
      bool bb;
      m = std::max(m, block_absmax(xp, xbf, b * B, std::min(n, (b + 1) * B), &bb));
      bad = bad || bb;
    }
    const float s = stored_scale(m, bad, qmax, sbf);
    put_scale(0, s);
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(static)
    for (int64_t b = 0; b < nb; ++b) encode(xp, xbf, b * B, std::min(n, (b + 1) * B), s, f, off, key, cp);
    return;
  }
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * B, i1 = std::min(n, (b + 1) * B);
    bool bad = false;
    const float absmax = block_absmax(xp, xbf, i0, i1, &bad);  // sets bad: sequence before use
    const float s = stored_scale(absmax, bad, qmax, sbf);
    put_scale(b, s);
    encode(xp, xbf, i0, i1, s, f, off, key, cp);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CPU, m) { m.impl("weight_quantize_sr_out", &weight_quantize_sr_out); }
