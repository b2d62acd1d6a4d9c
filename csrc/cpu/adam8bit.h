// One block of the blockwise 8-bit Adam step (bitsandbytes' state layout), shared by adam8bit.cpp (the
// optimizer op) and master_free.cpp (the fused master-free update). The design note is adam8bit.cpp's.
//
// Header-only and inline, compiled into each CPU variant with that variant's flags (isa.h picks the
// path); the code maps' tables are cached per shared object.
#pragma once

#include "avx2.h"
#include "isa.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
#include <immintrin.h>
#endif

namespace ppq::adam8 {

constexpr int64_t kBlock = 256;  // bitsandbytes' blockwise optimizer block

// A code map with its nearest-code table (see adam8bit.cpp's design note).
struct Map {
  float value[256];
  float mid[256];  // mid[i] = (value[i] + value[i + 1]) / 2, mid[255] = +inf
  // Cells: index = min(bits(y) >> 16, kTop): the sign, the exponent and 7 mantissa bits of y, so the
  // index costs a shift and a min (the negative cells follow at 0x8000 + the magnitude's index).
  // Positive y from 1.0078 up (Inf, NaN) share the cells above kOne, every y <= -1.0 the cell kTop.
  static constexpr uint32_t kOne = 0x3f80u, kTop = 0xbf80u;  // the cells of 1.0 and -1.0
  static constexpr int kCells = int(kTop) + 1;
  // Per cell: (midpoints below the cell) << 16 | low, with low = 0xffff - (low 16 bits of the midpoint
  // inside a positive cell), or the low 16 bits of the one inside a negative cell; 0 if none. The code
  // of y is then (entry + w) >> 16, w = the low 16 bits of y (of ~y for negative y): the carry is the
  // comparison with the midpoint.
  std::vector<uint32_t> entry;
  bool lut = true;  // false: some cell holds two midpoints (or a shared cell one); encode() bisects
  // The decode's byte planes (avx512vbmi): plane[k][i] = byte k of value[i].
  alignas(64) uint8_t plane[4][256];
};

inline std::unique_ptr<Map> build_map(const float* v) {
  auto m = std::make_unique<Map>();
  for (int i = 0; i < 256; ++i) m->value[i] = v[i];
  for (int i = 0; i < 256; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(v[i]);
    for (int k = 0; k < 4; ++k) m->plane[k][i] = uint8_t(u >> (8 * k));
  }
  for (int i = 0; i < 255; ++i) m->mid[i] = (v[i] + v[i + 1]) / 2.0f;
  m->mid[255] = INFINITY;
  m->entry.assign(Map::kCells, 0);
  for (int i = 0; i < 255; ++i) {  // the shared cells (|y| >= 1.0078) must hold no midpoint
    if (!(std::fabs(m->mid[i]) < 1.0f)) m->lut = false;
  }
  float sorted[255];  // the midpoints in order (a map need not be sorted)
  std::copy(m->mid, m->mid + 255, sorted);
  std::sort(sorted, sorted + 255);
  for (uint32_t k = 0; k <= Map::kOne; ++k) {
    const float lo = std::bit_cast<float>(k << 16), hi = std::bit_cast<float>((k + 1) << 16);
    // positive cell [lo, hi) and negative cell (-hi, -lo]
    const auto below_pos = uint32_t(std::lower_bound(sorted, sorted + 255, lo) - sorted);
    const auto below_neg = uint32_t(std::upper_bound(sorted, sorted + 255, -hi) - sorted);
    const auto in_pos = uint32_t(std::lower_bound(sorted, sorted + 255, hi) - sorted) - below_pos;
    const auto in_neg = uint32_t(std::upper_bound(sorted, sorted + 255, -lo) - sorted) - below_neg;
    if (in_pos > 1 || in_neg > 1) m->lut = false;
    const uint32_t low_pos = in_pos ? 0xffffu - (std::bit_cast<uint32_t>(sorted[below_pos]) & 0xffffu) : 0u;
    const uint32_t low_neg = in_neg ? std::bit_cast<uint32_t>(sorted[below_neg]) & 0xffffu : 0u;
    m->entry[k] = below_pos << 16 | low_pos;
    m->entry[0x8000u + k] = below_neg << 16 | low_neg;
  }
  for (uint32_t k = Map::kOne + 1; k < 0x8000u; ++k) m->entry[k] = m->entry[Map::kOne];  // Inf, NaN
  return m;
}

// The map for these 256 values, built once: optimizers call with the same two maps every step. The
// caller shares ownership while it steps: a later call (the step's other map, another thread) may
// evict the entry from the cache of the last 8 maps.
inline std::shared_ptr<const Map> get_map(const float* v) {
  static std::mutex mu;
  static std::vector<std::shared_ptr<const Map>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& m : cache) {
    if (std::memcmp(m->value, v, sizeof(m->value)) == 0) return m;
  }
  if (cache.size() >= 8) cache.erase(cache.begin());
  cache.push_back(build_map(v));
  return cache.back();
}

inline uint32_t cell(uint32_t u) { return std::min(u >> 16, Map::kTop); }

// Index of the nearest code: the number of midpoints below y (y == a midpoint: the lower code; NaN,
// of either sign: the last code, as the reference's bucketize).
inline uint8_t encode(const Map& m, float y) {
  if (y != y) return 255;
  if (m.lut) {
    const uint32_t u = std::bit_cast<uint32_t>(y);
    const uint32_t w = (u ^ uint32_t(int32_t(u) >> 31)) & 0xffffu;
    return uint8_t((m.entry[cell(u)] + w) >> 16);
  }
  int k = 0;
  for (int step = 128; step >= 1; step >>= 1) k += step & -int(m.mid[k + step - 1] < y);
  return uint8_t(k);
}

// The step's scalars, as the reference's fp32 tensor ops see them.
struct Hyper {
  float b1, b2, ob1, ob2;  // beta1, beta2, 1 - beta1, 1 - beta2
  float eps2;              // eps * sqrt(1 - beta2^t)
  float step_size;         // -lr * sqrt(1 - beta2^t) / (1 - beta1^t)
  float gs, decay;         // gnorm_scale, 1 - lr * weight_decay
  bool wd, scale_g;        // weight_decay > 0, gnorm_scale != 1
};

inline Hyper make_hyper(double beta1, double beta2, double eps, int64_t step, double lr, double weight_decay,
                        double gnorm_scale) {
  const double c1 = 1.0 - std::pow(beta1, double(step)), c2 = std::sqrt(1.0 - std::pow(beta2, double(step)));
  Hyper h;
  h.b1 = float(beta1), h.b2 = float(beta2), h.ob1 = float(1.0 - beta1), h.ob2 = float(1.0 - beta2);
  h.eps2 = float(eps * c2);
  h.step_size = float((-lr * c2) / c1);
  h.gs = float(gnorm_scale), h.decay = float(1.0 - lr * weight_decay);
  h.wd = weight_decay > 0.0, h.scale_g = h.gs != 1.0f;
  return h;
}

#if PPQ_ISA_AVX512
// encode() for 16 values (lut maps only), the codes in the low byte of each 32-bit lane.
PPQ_ALWAYS_INLINE inline __m512i encode16(const Map& m, __m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i k = _mm512_min_epu32(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(Map::kTop));
  const __m512i e = _mm512_i32gather_epi32(k, m.entry.data(), 4);
  const __m512i w = _mm512_and_si512(_mm512_xor_si512(u, _mm512_srai_epi32(u, 31)), _mm512_set1_epi32(0xffff));
  return _mm512_srli_epi32(_mm512_add_epi32(e, w), 16);
}
#endif

#ifdef __AVX512VBMI__
// decode64's permutation: position 16 L + 4 k + t of the permuted codes holds code 16 k + 4 L + t.
struct CodeShuffle {
  alignas(64) uint8_t v[64];
  constexpr CodeShuffle() : v{} {
    for (int L = 0; L < 4; ++L)
      for (int k = 0; k < 4; ++k)
        for (int t = 0; t < 4; ++t) v[16 * L + 4 * k + t] = uint8_t(16 * k + 4 * L + t);
  }
};
inline constexpr CodeShuffle kShuffle{};

// The values of 64 codes (bytes at c), 16 per vector in order: each of a value's four bytes is a
// 256-entry byte look-up (two 128-entry vpermi2b, picked by the code's top bit), and two rounds of
// unpacks interleave the four byte planes into floats. The unpacks work within 128-bit lanes, so the
// codes are first permuted (kShuffle) such that vector k comes out holding codes 16k..16k+15.
PPQ_ALWAYS_INLINE inline void decode64(const Map& m, const uint8_t* c, __m512 out[4]) {
  const __m512i idx = _mm512_permutexvar_epi8(_mm512_load_si512(kShuffle.v), _mm512_loadu_si512(c));
  const __mmask64 top = _mm512_movepi8_mask(idx);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i* t = reinterpret_cast<const __m512i*>(m.plane[k]);
    b[k] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(_mm512_load_si512(t), idx, _mm512_load_si512(t + 1)),
                                  _mm512_permutex2var_epi8(_mm512_load_si512(t + 2), idx, _mm512_load_si512(t + 3)));
  }
  const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}
#endif

#if PPQ_ISA_AVX2
// encode16 on 8 lanes: the cell index (a shift and a min), one gather of the cell entries, the
// comparison by the carry.
PPQ_ALWAYS_INLINE inline __m256i encode8(const Map& m, __m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i k = _mm256_min_epu32(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(Map::kTop));
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(m.entry.data()), k, 4);
  const __m256i w = _mm256_and_si256(_mm256_xor_si256(u, _mm256_srai_epi32(u, 31)), _mm256_set1_epi32(0xffff));
  return _mm256_srli_epi32(_mm256_add_epi32(e, w), 16);
}

// The values of 8 codes (bytes at c): eight scalar loads. On Zen 3 an 8-lane vgatherdps from the 1 KiB
// map costs more than the loads and inserts (2.6 against 2.3 ns per parameter for the whole step).
PPQ_ALWAYS_INLINE inline __m256 decode8(const float* t, const uint8_t* c) {
  uint64_t b;
  std::memcpy(&b, c, 8);
  return _mm256_setr_ps(t[b & 255], t[(b >> 8) & 255], t[(b >> 16) & 255], t[(b >> 24) & 255],
                        t[(b >> 32) & 255], t[(b >> 40) & 255], t[(b >> 48) & 255], t[b >> 56]);
}
#endif

// The bits of |x|: for magnitudes the integer order is the float order, with NaN above +Inf.
inline uint32_t abs_bits(float x) { return std::bit_cast<uint32_t>(x) & 0x7fffffffu; }

// One block of len <= kBlock values: p, g, q1, q2 point at the block's first value, a1/a2 at its
// absmax. Decode, Adam update, new absmax, encode (the reference's operations in its order).
// The absmax is the largest magnitude's bit pattern (the second moment is >= 0 or NaN): a NaN moment
// makes it NaN, as the reference's amax. A block whose absmax is not finite holds NaN or Inf moments,
// which the scalar encode() codes as the reference does (Inf * (1 / Inf) is NaN: the last code).
inline void block_step(const Hyper& h, const Map& m1, const Map& m2, float* __restrict pp,
                       const float* __restrict gp, uint8_t* __restrict q1, uint8_t* __restrict q2, float* a1p,
                       float* a2p, int64_t len) {
  alignas(64) float s1[kBlock], s2[kBlock];
  const float a1 = *a1p, a2 = *a2p;
  uint32_t mb1 = 0, mb2 = 0;  // the absmax bits
  int64_t j = 0;
#if PPQ_ISA_AVX512
  {  // the loop below, 16 values at a time (same operations, same order)
    const __m512 vb1 = _mm512_set1_ps(h.b1), vb2 = _mm512_set1_ps(h.b2), vob1 = _mm512_set1_ps(h.ob1);
    const __m512 vob2 = _mm512_set1_ps(h.ob2), veps = _mm512_set1_ps(h.eps2), vgs = _mm512_set1_ps(h.gs);
    const __m512 vdecay = _mm512_set1_ps(h.decay), vstep = _mm512_set1_ps(h.step_size);
    const __m512 va1 = _mm512_set1_ps(a1), va2 = _mm512_set1_ps(a2);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512i vmx1 = _mm512_setzero_si512(), vmx2 = _mm512_setzero_si512();
    // Values i0..i0+15, e1/e2 their states' code-map values.
    auto step16 = [&](int64_t i0, __m512 e1, __m512 e2) PPQ_ALWAYS_INLINE {
      __m512 gi = _mm512_loadu_ps(gp + i0);
      if (h.scale_g) gi = _mm512_mul_ps(gi, vgs);
      const __m512 d1 = _mm512_mul_ps(_mm512_mul_ps(e1, va1), vb1);
      const __m512 d2 = _mm512_mul_ps(_mm512_mul_ps(e2, va2), vb2);
      const __m512 v1 = _mm512_add_ps(d1, _mm512_mul_ps(gi, vob1));
      const __m512 v2 = _mm512_add_ps(d2, _mm512_mul_ps(_mm512_mul_ps(gi, gi), vob2));
      _mm512_store_ps(s1 + i0, v1);
      _mm512_store_ps(s2 + i0, v2);
      vmx1 = _mm512_max_epu32(vmx1, _mm512_and_si512(_mm512_castps_si512(v1), abs_mask));
      vmx2 = _mm512_max_epu32(vmx2, _mm512_and_si512(_mm512_castps_si512(v2), abs_mask));
      __m512 w = _mm512_loadu_ps(pp + i0);
      if (h.wd) w = _mm512_mul_ps(w, vdecay);
      const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v2), veps);
      _mm512_storeu_ps(pp + i0, _mm512_add_ps(w, _mm512_mul_ps(vstep, _mm512_div_ps(v1, denom))));
    };
#ifdef __AVX512VBMI__
    for (; j + 64 <= len; j += 64) {
      __m512 e1[4], e2[4];
      decode64(m1, q1 + j, e1);
      decode64(m2, q2 + j, e2);
      for (int k = 0; k < 4; ++k) step16(j + 16 * k, e1[k], e2[k]);
    }
#endif
    for (; j + 16 <= len; j += 16) {
      const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + j)));
      const __m512i c2 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q2 + j)));
      step16(j, _mm512_i32gather_ps(c1, m1.value, 4), _mm512_i32gather_ps(c2, m2.value, 4));
    }
    mb1 = _mm512_reduce_max_epu32(vmx1);
    mb2 = _mm512_reduce_max_epu32(vmx2);
  }
#elif PPQ_ISA_AVX2
  {  // the loop below, 8 values at a time (same operations, same order)
    const __m256 vb1 = _mm256_set1_ps(h.b1), vb2 = _mm256_set1_ps(h.b2), vob1 = _mm256_set1_ps(h.ob1);
    const __m256 vob2 = _mm256_set1_ps(h.ob2), veps = _mm256_set1_ps(h.eps2), vgs = _mm256_set1_ps(h.gs);
    const __m256 vdecay = _mm256_set1_ps(h.decay), vstep = _mm256_set1_ps(h.step_size);
    const __m256 va1 = _mm256_set1_ps(a1), va2 = _mm256_set1_ps(a2);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    __m256i vmx1 = _mm256_setzero_si256(), vmx2 = _mm256_setzero_si256();
    for (; j + 8 <= len; j += 8) {
      __m256 gi = _mm256_loadu_ps(gp + j);
      if (h.scale_g) gi = _mm256_mul_ps(gi, vgs);
      const __m256 d1 = _mm256_mul_ps(_mm256_mul_ps(decode8(m1.value, q1 + j), va1), vb1);
      const __m256 d2 = _mm256_mul_ps(_mm256_mul_ps(decode8(m2.value, q2 + j), va2), vb2);
      const __m256 v1 = _mm256_add_ps(d1, _mm256_mul_ps(gi, vob1));
      const __m256 v2 = _mm256_add_ps(d2, _mm256_mul_ps(_mm256_mul_ps(gi, gi), vob2));
      _mm256_store_ps(s1 + j, v1);
      _mm256_store_ps(s2 + j, v2);
      vmx1 = _mm256_max_epu32(vmx1, _mm256_and_si256(_mm256_castps_si256(v1), abs_mask));
      vmx2 = _mm256_max_epu32(vmx2, _mm256_and_si256(_mm256_castps_si256(v2), abs_mask));
      __m256 w = _mm256_loadu_ps(pp + j);
      if (h.wd) w = _mm256_mul_ps(w, vdecay);
      const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v2), veps);
      _mm256_storeu_ps(pp + j, _mm256_add_ps(w, _mm256_mul_ps(vstep, _mm256_div_ps(v1, denom))));
    }
    alignas(32) uint32_t t1[8], t2[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t1), vmx1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(t2), vmx2);
    for (int l = 0; l < 8; ++l) {
      mb1 = std::max(mb1, t1[l]);
      mb2 = std::max(mb2, t2[l]);
    }
  }
#endif
  for (int64_t i = j; i < len; ++i) {
    const float gi = h.scale_g ? gp[i] * h.gs : gp[i];
    const float v1 = m1.value[q1[i]] * a1 * h.b1 + gi * h.ob1;
    const float v2 = m2.value[q2[i]] * a2 * h.b2 + gi * gi * h.ob2;
    s1[i] = v1;
    s2[i] = v2;
    mb1 = std::max(mb1, abs_bits(v1));
    mb2 = std::max(mb2, abs_bits(v2));
    float w = pp[i];
    if (h.wd) w = w * h.decay;
    const float denom = std::sqrt(v2) + h.eps2;
    pp[i] = w + h.step_size * (v1 / denom);
  }
  const float mx1 = std::bit_cast<float>(mb1), mx2 = std::bit_cast<float>(mb2);
  *a1p = mx1;
  *a2p = mx2;
  // all-zero block: codes of 0; a NaN absmax: 1, as the reference's where(a > 0, a, 1)
  const float r1 = 1.0f / (mx1 > 0.0f ? mx1 : 1.0f), r2 = 1.0f / (mx2 > 0.0f ? mx2 : 1.0f);
  [[maybe_unused]] const bool fast = m1.lut && m2.lut && std::isfinite(mx1) && std::isfinite(mx2);
  int64_t i = 0;
#if PPQ_ISA_AVX512
  if (fast) {
    const __m512 vr1 = _mm512_set1_ps(r1), vr2 = _mm512_set1_ps(r2);
    for (; i + 16 <= len; i += 16) {
      const __m512i c1 = encode16(m1, _mm512_mul_ps(_mm512_load_ps(s1 + i), vr1));
      const __m512i c2 = encode16(m2, _mm512_mul_ps(_mm512_load_ps(s2 + i), vr2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + i), _mm512_cvtepi32_epi8(c1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i), _mm512_cvtepi32_epi8(c2));
    }
  }
#elif PPQ_ISA_AVX2
  if (fast) {
    const __m256 vr1 = _mm256_set1_ps(r1), vr2 = _mm256_set1_ps(r2);
    for (; i + 16 <= len; i += 16) {
      const __m256i a = encode8(m1, _mm256_mul_ps(_mm256_load_ps(s1 + i), vr1));
      const __m256i b = encode8(m1, _mm256_mul_ps(_mm256_load_ps(s1 + i + 8), vr1));
      const __m256i c = encode8(m2, _mm256_mul_ps(_mm256_load_ps(s2 + i), vr2));
      const __m256i d = encode8(m2, _mm256_mul_ps(_mm256_load_ps(s2 + i + 8), vr2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + i), ppq::avx2::bytes16(a, b));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i), ppq::avx2::bytes16(c, d));
    }
  }
#endif
  for (; i < len; ++i) {
    q1[i] = encode(m1, s1[i] * r1);
    q2[i] = encode(m2, s2[i] * r2);
  }
}

}  // namespace ppq::adam8
