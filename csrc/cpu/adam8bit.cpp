// Adam/AdamW with blockwise 8-bit states (bitsandbytes' layout) on CPU: one fused pass per block.
//
// Design note.
// * The math is deepspeed_ppq/quant/adam8bit.py's reference, operation for operation in fp32: per
//   block of 256 values, states decoded through the 256-entry code maps and the block absmax, the Adam
//   update (decoupled weight decay), the new block absmax, and the states re-encoded to the NEAREST
//   code (the count of code midpoints below the normalised value; a tie goes to the lower code). The
//   tests hold this kernel to the reference.
// * Why: bitsandbytes' CPU backend runs the same algorithm as a dozen whole-tensor PyTorch ops plus a
//   binary-search quantizer, ~20 ns per parameter, 40x a fused fp32 Adam; the 8-bit states the
//   autotuner wants for their memory then cost more time than they save.
// * One pass over memory: a block's new states wait in two 1 KiB stack buffers (L1) between the update
//   and the encode. Blocks are independent: OpenMP splits them statically.
// * The encode looks the nearest code up by the value's float bits instead of searching: the top 16
//   bits (sign, exponent, 7 mantissa bits) of y in [-1, 1] name a cell of width 2^-7 relative; for
//   bitsandbytes' maps no cell holds more than one midpoint (checked when the table is built), so the
//   code is base[cell] (midpoints below the cell) + (y > the cell's midpoint). Values below 2^-24 share
//   the first cell. Two 24 KiB tables per map, built once per map and cached; a map that breaks the
//   one-midpoint rule falls back to a branch-free binary search. With AVX-512 a block runs 16 values at
//   a time (AVX2: 8), table reads as gathers (2.5 ns per parameter on one core here; a scalar bisection with
//   branches ran at 80 ns, bitsandbytes' CPU backend at ~20 ns).
// * Built with -ffp-contract=off (setup.py): products and sums round separately, as the reference's.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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
// GCC 12's false positive on the intrinsics' _mm512_undefined_*() placeholders (see weights.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

constexpr int64_t kBlock = 256;  // bitsandbytes' blockwise optimizer block

// A code map with its nearest-code tables.
struct Map {
  float value[256];
  float mid[256];  // mid[i] = (value[i] + value[i + 1]) / 2, mid[255] = +inf
  // Cells: index = sign * kCells + clamp(|bits| >> 16, kKey0, kKey1) - kKey0.
  static constexpr uint32_t kKey0 = 0x33800000u >> 16, kKey1 = 0x3f800000u >> 16;  // 2^-24 and 1.0
  static constexpr int kCells = int(kKey1 - kKey0) + 1;
  std::vector<int32_t> base;  // midpoints below the cell
  std::vector<float> cell_mid;  // the midpoint inside the cell, +inf if none
  bool lut = true;  // false: some cell holds two midpoints; encode() bisects instead
};

inline float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

std::unique_ptr<Map> build_map(const float* v) {
  auto m = std::make_unique<Map>();
  for (int i = 0; i < 256; ++i) m->value[i] = v[i];
  for (int i = 0; i < 255; ++i) m->mid[i] = (v[i] + v[i + 1]) / 2.0f;
  m->mid[255] = INFINITY;
  m->base.assign(2 * Map::kCells, 0);
  m->cell_mid.assign(2 * Map::kCells, INFINITY);
  for (int c = 0; c < Map::kCells; ++c) {
    const uint32_t k = Map::kKey0 + uint32_t(c);
    const float lo = c == 0 ? 0.0f : from_bits(k << 16), hi = from_bits((k + 1) << 16);
    int below_pos = 0, below_neg = 0, in_pos = 0, in_neg = 0;
    for (int i = 0; i < 255; ++i) {
      const float x = m->mid[i];
      below_pos += x < lo;   // positive cell [lo, hi)
      below_neg += x <= -hi;  // negative cell (-hi, -lo]
      if (x >= lo && x < hi) m->cell_mid[c] = x, ++in_pos;
      if (x > -hi && x <= -lo) m->cell_mid[Map::kCells + c] = x, ++in_neg;
    }
    m->base[c] = below_pos;
    m->base[Map::kCells + c] = below_neg;
    if (in_pos > 1 || in_neg > 1) m->lut = false;
  }
  return m;
}

// The map for these 256 values, built once: optimizers call with the same two maps every step.
const Map& get_map(const at::Tensor& q) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<Map>> cache;
  const float* v = q.data_ptr<float>();
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& m : cache) {
    if (std::memcmp(m->value, v, sizeof(m->value)) == 0) return *m;
  }
  if (cache.size() >= 8) cache.erase(cache.begin());
  cache.push_back(build_map(v));
  return *cache.back();
}

inline int cell(float y) {
  const uint32_t u = std::bit_cast<uint32_t>(y);
  const uint32_t k = std::min(std::max((u & 0x7fffffffu) >> 16, Map::kKey0), Map::kKey1) - Map::kKey0;
  return int(k) + (u >> 31 ? Map::kCells : 0);
}

// Index of the nearest code: the number of midpoints below y (y == a midpoint: the lower code).
inline uint8_t encode(const Map& m, float y) {
  if (m.lut) {
    const int c = cell(y);
    return uint8_t(m.base[c] + (m.cell_mid[c] < y));
  }
  int k = 0;
  for (int step = 128; step >= 1; step >>= 1) k += step & -int(m.mid[k + step - 1] < y);
  return uint8_t(k);
}

#if PPQ_ISA_AVX512
// encode() for 16 values (lut maps only), the codes in the low byte of each 32-bit lane.
inline __m512i encode16(const Map& m, __m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  __m512i k = _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), 16);
  k = _mm512_min_epu32(_mm512_max_epu32(k, _mm512_set1_epi32(Map::kKey0)), _mm512_set1_epi32(Map::kKey1));
  k = _mm512_sub_epi32(k, _mm512_set1_epi32(Map::kKey0));
  k = _mm512_mask_add_epi32(k, _mm512_movepi32_mask(u), k, _mm512_set1_epi32(Map::kCells));  // sign bit
  const __m512i base = _mm512_i32gather_epi32(k, m.base.data(), 4);
  const __m512 mid = _mm512_i32gather_ps(k, m.cell_mid.data(), 4);
  return _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(mid, y, _CMP_LT_OQ), base, _mm512_set1_epi32(1));
}
#endif

#if PPQ_ISA_AVX2
// encode() for 8 values (lut maps only): encode16 on 8 lanes.
inline __m256i encode8(const Map& m, __m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  __m256i k = _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), 16);
  k = _mm256_min_epu32(_mm256_max_epu32(k, _mm256_set1_epi32(Map::kKey0)), _mm256_set1_epi32(Map::kKey1));
  k = _mm256_sub_epi32(k, _mm256_set1_epi32(Map::kKey0));
  k = _mm256_add_epi32(k, _mm256_and_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(Map::kCells)));  // sign bit
  const __m256i base = _mm256_i32gather_epi32(m.base.data(), k, 4);
  const __m256 mid = _mm256_i32gather_ps(m.cell_mid.data(), k, 4);
  return _mm256_sub_epi32(base, _mm256_castps_si256(_mm256_cmp_ps(mid, y, _CMP_LT_OQ)));  // + 1 where mid < y
}
#endif

void check_state(const at::Tensor& t, const char* name, at::ScalarType dt, int64_t n) {
  TORCH_CHECK(t.scalar_type() == dt, name, " has dtype ", t.scalar_type(), "; needs ", dt);
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements; needs ", n);
}

void adam8bit_blockwise_step_(at::Tensor& p, const at::Tensor& g, at::Tensor& state1, at::Tensor& state2,
                              at::Tensor& absmax1, at::Tensor& absmax2, const at::Tensor& qmap1,
                              const at::Tensor& qmap2, double beta1, double beta2, double eps, int64_t step,
                              double lr, double weight_decay, double gnorm_scale) {
  const int64_t n = p.numel(), nb = (n + kBlock - 1) / kBlock;
  check_state(p, "p", at::kFloat, n);
  check_state(g, "g", at::kFloat, n);
  check_state(state1, "state1", at::kByte, n);
  check_state(state2, "state2", at::kByte, n);
  check_state(absmax1, "absmax1", at::kFloat, nb);
  check_state(absmax2, "absmax2", at::kFloat, nb);
  check_state(qmap1, "qmap1", at::kFloat, 256);
  check_state(qmap2, "qmap2", at::kFloat, 256);
  TORCH_CHECK(step >= 1, "step=", step, " must be >= 1");
  const Map& m1 = get_map(qmap1);
  const Map& m2 = get_map(qmap2);
  // The scalars as the reference's fp32 tensor ops see them.
  const float b1 = float(beta1), b2 = float(beta2), ob1 = float(1.0 - beta1), ob2 = float(1.0 - beta2);
  const float c2 = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
  const float step_size = float(-lr / (1.0 - std::pow(beta1, double(step))));
  const float e = float(eps), gs = float(gnorm_scale), decay = float(1.0 - lr * weight_decay);
  const bool wd = weight_decay > 0.0;
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  uint8_t* q1 = state1.data_ptr<uint8_t>();
  uint8_t* q2 = state2.data_ptr<uint8_t>();
  float* a1p = absmax1.data_ptr<float>();
  float* a2p = absmax2.data_ptr<float>();
#pragma omp parallel for num_threads(std::max(1, at::get_num_threads())) schedule(static) if (n > (1 << 16))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock, len = std::min(kBlock, n - i0);
    alignas(64) float s1[kBlock], s2[kBlock];
    const float a1 = a1p[b], a2 = a2p[b];
    float mx1 = 0.0f, mx2 = 0.0f;
    int64_t j = 0;
#if PPQ_ISA_AVX512
    {  // the loop below, 16 values at a time (same operations, same order)
      const __m512 vb1 = _mm512_set1_ps(b1), vb2 = _mm512_set1_ps(b2), vob1 = _mm512_set1_ps(ob1);
      const __m512 vob2 = _mm512_set1_ps(ob2), vc2 = _mm512_set1_ps(c2), ve = _mm512_set1_ps(e);
      const __m512 vgs = _mm512_set1_ps(gs), vdecay = _mm512_set1_ps(decay), vstep = _mm512_set1_ps(step_size);
      const __m512 va1 = _mm512_set1_ps(a1), va2 = _mm512_set1_ps(a2);
      const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
      __m512 vmx1 = _mm512_setzero_ps(), vmx2 = _mm512_setzero_ps();
      for (; j + 16 <= len; j += 16) {
        const int64_t k = i0 + j;
        const __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(gp + k), vgs);
        const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + k)));
        const __m512i c2i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q2 + k)));
        const __m512 d1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_i32gather_ps(c1, m1.value, 4), va1), vb1);
        const __m512 d2 = _mm512_mul_ps(_mm512_mul_ps(_mm512_i32gather_ps(c2i, m2.value, 4), va2), vb2);
        const __m512 v1 = _mm512_add_ps(d1, _mm512_mul_ps(gi, vob1));
        const __m512 v2 = _mm512_add_ps(d2, _mm512_mul_ps(_mm512_mul_ps(gi, gi), vob2));
        _mm512_store_ps(s1 + j, v1);
        _mm512_store_ps(s2 + j, v2);
        vmx1 = _mm512_max_ps(vmx1, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), abs_mask)));
        vmx2 = _mm512_max_ps(vmx2, v2);
        __m512 w = _mm512_loadu_ps(pp + k);
        if (wd) w = _mm512_mul_ps(w, vdecay);
        const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v2), vc2), ve);
        _mm512_storeu_ps(pp + k, _mm512_add_ps(w, _mm512_mul_ps(vstep, _mm512_div_ps(v1, denom))));
      }
      mx1 = _mm512_reduce_max_ps(vmx1);
      mx2 = _mm512_reduce_max_ps(vmx2);
    }
#elif PPQ_ISA_AVX2
    {  // the loop below, 8 values at a time (same operations, same order)
      const __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2), vob1 = _mm256_set1_ps(ob1);
      const __m256 vob2 = _mm256_set1_ps(ob2), vc2 = _mm256_set1_ps(c2), ve = _mm256_set1_ps(e);
      const __m256 vgs = _mm256_set1_ps(gs), vdecay = _mm256_set1_ps(decay), vstep = _mm256_set1_ps(step_size);
      const __m256 va1 = _mm256_set1_ps(a1), va2 = _mm256_set1_ps(a2);
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 vmx1 = _mm256_setzero_ps(), vmx2 = _mm256_setzero_ps();
      for (; j + 8 <= len; j += 8) {
        const int64_t k = i0 + j;
        const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(gp + k), vgs);
        const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q1 + k)));
        const __m256i c2i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q2 + k)));
        const __m256 d1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_i32gather_ps(m1.value, c1, 4), va1), vb1);
        const __m256 d2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_i32gather_ps(m2.value, c2i, 4), va2), vb2);
        const __m256 v1 = _mm256_add_ps(d1, _mm256_mul_ps(gi, vob1));
        const __m256 v2 = _mm256_add_ps(d2, _mm256_mul_ps(_mm256_mul_ps(gi, gi), vob2));
        _mm256_store_ps(s1 + j, v1);
        _mm256_store_ps(s2 + j, v2);
        // max with the accumulator second: a NaN lane is skipped, as std::max(mx, NaN) in the scalar loop
        vmx1 = _mm256_max_ps(_mm256_and_ps(v1, abs_mask), vmx1);
        vmx2 = _mm256_max_ps(v2, vmx2);
        __m256 w = _mm256_loadu_ps(pp + k);
        if (wd) w = _mm256_mul_ps(w, vdecay);
        const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v2), vc2), ve);
        _mm256_storeu_ps(pp + k, _mm256_add_ps(w, _mm256_mul_ps(vstep, _mm256_div_ps(v1, denom))));
      }
      alignas(32) float t1[8], t2[8];
      _mm256_store_ps(t1, vmx1);
      _mm256_store_ps(t2, vmx2);
      for (int l = 0; l < 8; ++l) {
        mx1 = std::max(mx1, t1[l]);
        mx2 = std::max(mx2, t2[l]);
      }
    }
#endif
    for (int64_t i = j; i < len; ++i) {
      const float gi = gp[i0 + i] * gs;
      const float v1 = m1.value[q1[i0 + i]] * a1 * b1 + gi * ob1;
      const float v2 = m2.value[q2[i0 + i]] * a2 * b2 + gi * gi * ob2;
      s1[i] = v1;
      s2[i] = v2;
      mx1 = std::max(mx1, std::fabs(v1));
      mx2 = std::max(mx2, v2);
      float w = pp[i0 + i];
      if (wd) w = w * decay;
      const float denom = std::sqrt(v2) / c2 + e;
      pp[i0 + i] = w + step_size * (v1 / denom);
    }
    a1p[b] = mx1;
    a2p[b] = mx2;
    const float r1 = mx1 > 0.0f ? mx1 : 1.0f, r2 = mx2 > 0.0f ? mx2 : 1.0f;  // all-zero block: codes of 0
    int64_t i = 0;
#if PPQ_ISA_AVX512
    if (m1.lut && m2.lut) {
      const __m512 vr1 = _mm512_set1_ps(r1), vr2 = _mm512_set1_ps(r2);
      for (; i + 16 <= len; i += 16) {
        const __m512i c1 = encode16(m1, _mm512_div_ps(_mm512_load_ps(s1 + i), vr1));
        const __m512i c2 = encode16(m2, _mm512_div_ps(_mm512_load_ps(s2 + i), vr2));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + i0 + i), _mm512_cvtepi32_epi8(c1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i0 + i), _mm512_cvtepi32_epi8(c2));
      }
    }
#elif PPQ_ISA_AVX2
    if (m1.lut && m2.lut) {
      const __m256 vr1 = _mm256_set1_ps(r1), vr2 = _mm256_set1_ps(r2);
      for (; i + 16 <= len; i += 16) {
        const __m256i a = encode8(m1, _mm256_div_ps(_mm256_load_ps(s1 + i), vr1));
        const __m256i b = encode8(m1, _mm256_div_ps(_mm256_load_ps(s1 + i + 8), vr1));
        const __m256i c = encode8(m2, _mm256_div_ps(_mm256_load_ps(s2 + i), vr2));
        const __m256i d = encode8(m2, _mm256_div_ps(_mm256_load_ps(s2 + i + 8), vr2));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + i0 + i), ppq::avx2::bytes16(a, b));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i0 + i), ppq::avx2::bytes16(c, d));
      }
    }
#endif
    for (; i < len; ++i) {
      q1[i0 + i] = encode(m1, s1[i] / r1);
      q2[i0 + i] = encode(m2, s2[i] / r2);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CPU, m) { m.impl("adam8bit_blockwise_step_", &adam8bit_blockwise_step_); }
