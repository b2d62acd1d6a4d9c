// Stage-boundary codecs on CPU: fused min-max quantize+pack, unpack+dequantize, FP8 with group scales,
// TopK select (radix histogram, no sort) and scatter-back, and bit packing of indices.
//
// Design note. These kernels are memory bound: an activation is read once or twice and a payload a
// fraction of its size is written. So
//  * outputs are caller-provided views of one payload buffer (no allocation, no page faults);
//  * quantize works row by row when a row starts on a whole byte of the packed stream (the common
//    per-token case: row stats and codes are computed while the row is in L1/L2); otherwise group stats
//    are computed first and codes in byte-aligned chunks;
//  * codes are computed into a small stack buffer and then packed, so both loops vectorize
//    (round-half-even by the 1.5 * 2^23 trick on clamped non-negative values, bit-exact with
//    nearbyint/torch.round); 4- and 2-bit codes of a 1024-value segment inside one group (the
//    per-token case) are packed in registers instead, without the buffer;
//  * the row's stats pass reads memory and its codes pass computes from cache, one after the other;
//    the AVX2 codes loops (k-bit and FP8) therefore prefetch into L2 the values 16 KiB ahead (per token:
//    the next row), so memory streams during the compute. That took encode from 0.47-0.60x copy
//    (2-bit the lowest) to 0.7-0.8x, and min/max on four accumulators keeps the stats pass off the
//    min/max latency;
//  * TopK per sample: one pass builds a 65536-bin histogram of the top 16 bits of |x| (as IEEE bits,
//    which order like the values), a second pass keeps every index at or above the threshold bin in
//    ascending order, then the exact K-th key is found among the few candidates of the threshold bin
//    with nth_element and the list is compacted; ties go to the lower index (a stable sort's order).
//  * FP8 encode: group amax as an integer max over |x|'s bits, then the branch-free fp32 -> fp8 recipe
//    shared with the weight kernels (fp8.h), so both loops vectorise; decode reads a 256-entry table.
//  * pack_bits: blocks of 8 values (`bits` whole bytes), the 64-bit bit writer instantiated per width
//    so its shifts and stores are constants (0.42x -> 0.75x copy for 22-bit TopK indices; the
//    run-time-width writer branched per value and copied each block through a buffer); unpack_bits the
//    same way, one 64-bit read per value (0.46x -> 0.78x on a Zen 5: the run-time-width loop had also
//    zeroed a 64-byte pad buffer per block);
//  * TopK's candidate arrays are thread-local scratch, used through raw pointers: through the vectors,
//    each candidate's read beside a push_back reloaded the vector by a __tls_get_addr call (a quarter of
//    the select's time, as profiled with perf); the candidates' histogram spans only their bins (from
//    the threshold bin to the largest key's), two interleaved copies in L1. Zen 5: 0.25x -> 0.32x copy.
//  * one vector path, AVX2, for the avx2 and the avx512 modules (PPQ_HAS_AVX2): these loops are bound
//    by memory and by the TopK scan's compaction, not by the vector width (on an AVX-512 Zen 5 the
//    avx512 module had run the scalar loops: k-bit encode 0.17-0.23x copy against 0.60-0.68x for the
//    AVX2 ones on the same machine).
// The exact arithmetic every implementation follows is documented in deepspeed_ppq/compress/ops.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "isa.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "avx2.h"
#include "fp8.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if PPQ_HAS_AVX2
#include <immintrin.h>
// GCC 12's false positive on the intrinsics' placeholders in OpenMP-outlined functions (see weights.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

namespace fp8 = ppq::fp8;

// AT_DISPATCH_* is a macro, and an OpenMP pragma may not sit inside a macro argument; this one is a call.
template <typename F>
void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", t, ": use float32, bfloat16 or float16");
  }
}

constexpr int64_t kSeg = 1024;  // codes computed per stack buffer (a multiple of every pack unit)

int64_t pack_unit(int64_t bits) { return bits == 8 ? 1 : bits == 4 ? 2 : 4; }  // values per whole bytes
int64_t packed_nbytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }

inline float round_nonneg(float t) {  // round half to even, for 0 <= t < 2^22
  return (t + 12582912.0f) - 12582912.0f;
}

void check_bits(int64_t bits) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 6 || bits == 8, "bits must be 2, 4, 6 or 8, got ", bits);
}

void check_float_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous, got strides ", x.strides());
  auto d = x.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", d);
}

void check_buffer(const at::Tensor& t, at::ScalarType dt, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == dt, name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " must have ", n, " elements, got ", t.numel());
}

// Pack n codes (n a multiple of pack_unit, or the stream's tail) into dst.
void pack(const uint8_t* c, int64_t n, int64_t bits, uint8_t* dst) {
  if (bits == 8) {
    std::memcpy(dst, c, n);
  } else if (bits == 4) {
    int64_t m = n / 2;
    for (int64_t j = 0; j < m; ++j) dst[j] = c[2 * j] | (c[2 * j + 1] << 4);
    if (n & 1) dst[m] = c[n - 1];
  } else if (bits == 2) {
    int64_t m = n / 4;
    for (int64_t j = 0; j < m; ++j)
      dst[j] = c[4 * j] | (c[4 * j + 1] << 2) | (c[4 * j + 2] << 4) | (c[4 * j + 3] << 6);
    if (n % 4) {
      uint8_t b = 0;
      for (int64_t i = 4 * m; i < n; ++i) b |= c[i] << (2 * (i - 4 * m));
      dst[m] = b;
    }
  } else {  // 6 bits: 4 values in 3 bytes
    int64_t m = n / 4;
    for (int64_t j = 0; j < m; ++j) {
      uint32_t w = c[4 * j] | (c[4 * j + 1] << 6) | (c[4 * j + 2] << 12) | (uint32_t(c[4 * j + 3]) << 18);
      dst[3 * j] = w & 255;
      dst[3 * j + 1] = (w >> 8) & 255;
      dst[3 * j + 2] = (w >> 16) & 255;
    }
    if (n % 4) {
      uint32_t w = 0;
      for (int64_t i = 4 * m; i < n; ++i) w |= uint32_t(c[i]) << (6 * (i - 4 * m));
      int64_t nb = packed_nbytes(n - 4 * m, 6);
      for (int64_t b = 0; b < nb; ++b) dst[3 * m + b] = (w >> (8 * b)) & 255;
    }
  }
}

// Unpack n codes starting at a whole byte.
void unpack(const uint8_t* src, int64_t n, int64_t bits, uint8_t* c) {
  if (bits == 8) {
    std::memcpy(c, src, n);
  } else if (bits == 4) {
    for (int64_t i = 0; i < n; ++i) c[i] = (src[i >> 1] >> (4 * (i & 1))) & 15;
  } else if (bits == 2) {
    for (int64_t i = 0; i < n; ++i) c[i] = (src[i >> 2] >> (2 * (i & 3))) & 3;
  } else {
    int64_t m = n / 4;
    for (int64_t j = 0; j < m; ++j) {
      uint32_t w = src[3 * j] | (src[3 * j + 1] << 8) | (uint32_t(src[3 * j + 2]) << 16);
      c[4 * j] = w & 63;
      c[4 * j + 1] = (w >> 6) & 63;
      c[4 * j + 2] = (w >> 12) & 63;
      c[4 * j + 3] = (w >> 18) & 63;
    }
    if (n % 4) {
      uint32_t w = 0;
      int64_t nb = packed_nbytes(n - 4 * m, 6);
      for (int64_t b = 0; b < nb; ++b) w |= uint32_t(src[3 * m + b]) << (8 * b);
      for (int64_t i = 4 * m; i < n; ++i) c[i] = (w >> (6 * (i - 4 * m))) & 63;
    }
  }
}

#if PPQ_HAS_AVX2
// ---- AVX2 pieces (the avx2 and avx512 modules; the scalar loops stay for tails, other dtypes) ---
// Each is the scalar loop beside it on 8 lanes, bit for bit: max_ps(t, 0) / min_ps(t, lv) select like
// `t > 0 ? t : 0` / `t < lv ? t : lv` (NaN -> 0), min_ps(v, mn) like `v < mn ? v : mn`, fmadd is
// std::fma, and bytes leave through avx2.h's truncating narrowing.
namespace v2 {

PPQ_ALWAYS_INLINE inline float hmin(__m256 v) {
  __m128 x = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_min_ps(x, _mm_movehl_ps(x, x));
  x = _mm_min_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
PPQ_ALWAYS_INLINE inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// min, max (NaN skipped) and whether there was a NaN, over x[0, n8) with n8 a multiple of 8 (> 0).
// Four accumulators of each, so the loop is not bound by min/max latency (min and max are order-free
// here: NaN lanes are skipped, and which zero wins a tie of -0 and +0 leaves the codes unchanged).
PPQ_ALWAYS_INLINE inline void minmax8(const float* x, int64_t n8, float& mn, float& mx, bool& nan) {
  __m256 vmn[4], vmx[4], vnan[4];
  for (int u = 0; u < 4; ++u) {
    vmn[u] = _mm256_set1_ps(INFINITY);
    vmx[u] = _mm256_set1_ps(-INFINITY);
    vnan[u] = _mm256_setzero_ps();
  }
  auto step = [&](int u, int64_t i) PPQ_ALWAYS_INLINE {
    const __m256 v = _mm256_loadu_ps(x + i);
    vmn[u] = _mm256_min_ps(v, vmn[u]);
    vmx[u] = _mm256_max_ps(v, vmx[u]);
    vnan[u] = _mm256_or_ps(vnan[u], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  };
  const int64_t n32 = n8 & ~int64_t(31);
  for (int64_t i = 0; i < n32; i += 32) {
    step(0, i);
    step(1, i + 8);
    step(2, i + 16);
    step(3, i + 24);
  }
  for (int64_t i = n32; i < n8; i += 8) step(0, i);
  const __m256 a = _mm256_min_ps(_mm256_min_ps(vmn[0], vmn[1]), _mm256_min_ps(vmn[2], vmn[3]));
  const __m256 b = _mm256_max_ps(_mm256_max_ps(vmx[0], vmx[1]), _mm256_max_ps(vmx[2], vmx[3]));
  mn = hmin(a);
  mx = hmax(b);
  nan = _mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(vnan[0], vnan[1]), _mm256_or_ps(vnan[2], vnan[3]))) != 0;
}

// Codes of 8 values: round((x * p - mnp) * inv) clamped to [0, lv], the scalar loop's arithmetic.
struct Codes8 {
  __m256 vp, vmnp, vinv, vlv;
  Codes8(float p, float mnp, float inv, float lv)
      : vp(_mm256_set1_ps(p)), vmnp(_mm256_set1_ps(mnp)), vinv(_mm256_set1_ps(inv)), vlv(_mm256_set1_ps(lv)) {}
  PPQ_ALWAYS_INLINE __m256i operator()(const float* x) const {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(x), vp), vmnp), vinv);
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_setzero_ps()), vlv);
    return _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(t, magic), magic));
  }
};
// The codes loops run over values the stats pass has just brought into cache, and prefetch (into L2)
// those kAhead values further on: per token, the next row, whose stats pass then reads from L2 while
// memory streams during this compute.
constexpr int64_t kAhead = 4096;
PPQ_ALWAYS_INLINE inline void prefetch_ahead(const float* x) {
  _mm_prefetch(reinterpret_cast<const char*>(x + kAhead), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(x + kAhead + 16), _MM_HINT_T1);
}

// Codes of x[0, n32) (n32 a multiple of 32) into b.
PPQ_ALWAYS_INLINE inline void minmax_codes(const float* x, int64_t n32, float p, float mnp, float inv, float lv, uint8_t* b) {
  const Codes8 code8(p, mnp, inv, lv);
  for (int64_t i = 0; i < n32; i += 32) {
    prefetch_ahead(x + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b + i),
                        ppq::avx2::bytes32(code8(x + i), code8(x + i + 8), code8(x + i + 16), code8(x + i + 24)));
  }
}

// Codes of x[0, n32) (n32 a multiple of 32) packed straight into a 4- or 2-bit stream at dst: the codes
// of minmax_codes, the bytes of pack32, without the byte buffer in between. Codes lie in [0, lv], so the
// saturating packs are exact; they leave the 32 codes as 8 dwords of 4 consecutive codes, in the
// order 0 2 4 6 | 1 3 5 7 (groups of 4), which the final in-lane shuffle and interleave restore.
PPQ_ALWAYS_INLINE inline void minmax_codes_packed(const float* x, int64_t n32, float p, float mnp, float inv, float lv,
                                                  int64_t bits, uint8_t* dst) {
  const Codes8 c8(p, mnp, inv, lv);
  auto code8 = [&](int64_t i) PPQ_ALWAYS_INLINE { return c8(x + i); };
  if (bits == 2) {
    const __m256i first = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int64_t i = 0; i < n32; i += 32) {
      prefetch_ahead(x + i);
      const __m256i w = _mm256_packus_epi16(_mm256_packs_epi32(code8(i), code8(i + 8)),
                                            _mm256_packs_epi32(code8(i + 16), code8(i + 24)));
      const __m256i t16 = _mm256_maddubs_epi16(w, _mm256_set1_epi16(0x0401));     // c0 + 4 c1, c2 + 4 c3
      const __m256i t32 = _mm256_madd_epi16(t16, _mm256_set1_epi32(0x00100001));  // + 16 (c2 + 4 c3)
      const __m256i b = _mm256_shuffle_epi8(t32, first);  // bytes of groups 0 2 4 6 | 1 3 5 7
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i / 4),
                       _mm_unpacklo_epi8(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
  } else {
    for (int64_t i = 0; i < n32; i += 32) {
      prefetch_ahead(x + i);
      const __m256i w = _mm256_packus_epi16(_mm256_packs_epi32(code8(i), code8(i + 8)),
                                            _mm256_packs_epi32(code8(i + 16), code8(i + 24)));
      const __m256i t = _mm256_and_si256(_mm256_or_si256(w, _mm256_srli_epi16(w, 4)), _mm256_set1_epi16(0xff));
      const __m256i b = _mm256_packus_epi16(t, t);  // 2 bytes per group: 0 2 4 6 | 1 3 5 7 (twice)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i / 2),
                       _mm_unpacklo_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
  }
}

// 8 fp32 -> the output dtype (float, or bf16 rounded to nearest even).
PPQ_ALWAYS_INLINE inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
PPQ_ALWAYS_INLINE inline void store8(c10::BFloat16* o, __m256 v) {
  const __m256i r = ppq::avx2::bf16_bits8(v);
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), w);
}
template <typename T>
constexpr bool kVecOut = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// o[j] = fma(b[j], sc, mn) for j < n8 (a multiple of 8).
template <typename T>
PPQ_ALWAYS_INLINE inline void minmax_values(const uint8_t* b, int64_t n8, float sc, float mn, T* o) {
  const __m256 vsc = _mm256_set1_ps(sc), vmn = _mm256_set1_ps(mn);
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + j)));
    store8(o + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), vsc, vmn));
  }
}

// Unpack the first n32 (a multiple of 32) codes of a 6-, 4- or 2-bit stream starting at a whole byte.
PPQ_ALWAYS_INLINE inline void unpack32(const uint8_t* src, int64_t n32, int64_t bits, uint8_t* c) {
  if (bits == 4) {
    const __m128i m = _mm_set1_epi8(15);
    for (int64_t i = 0; i < n32; i += 32) {  // 16 bytes -> 32 codes, the low nibble first
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i / 2));
      const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i + 16), _mm_unpackhi_epi8(lo, hi));
    }
  } else if (bits == 6) {  // 12 bytes -> 16 codes, twice: 3 bytes per dword, then 6-bit fields to bytes
    const __m128i spread = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    auto load12 = [](const uint8_t* p) PPQ_ALWAYS_INLINE {
      int32_t t;
      std::memcpy(&t, p + 8, 4);
      return _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), t, 2);
    };
    for (int64_t i = 0; i < n32; i += 16) {
      const __m128i w = _mm_shuffle_epi8(load12(src + i / 4 * 3), spread);
      const __m128i r = _mm_or_si128(
          _mm_or_si128(_mm_and_si128(w, _mm_set1_epi32(0x3f)), _mm_and_si128(_mm_slli_epi32(w, 2), _mm_set1_epi32(0x3f00))),
          _mm_or_si128(_mm_and_si128(_mm_slli_epi32(w, 4), _mm_set1_epi32(0x3f0000)),
                       _mm_and_si128(_mm_slli_epi32(w, 6), _mm_set1_epi32(0x3f000000))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), r);
    }
  } else {  // 2 bits: 8 bytes -> 32 codes
    const __m128i m = _mm_set1_epi8(3);
    for (int64_t i = 0; i < n32; i += 32) {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i / 4));
      const __m128i a = _mm_and_si128(x, m), b = _mm_and_si128(_mm_srli_epi16(x, 2), m);
      const __m128i cc = _mm_and_si128(_mm_srli_epi16(x, 4), m), d = _mm_and_si128(_mm_srli_epi16(x, 6), m);
      const __m128i ab = _mm_unpacklo_epi8(a, b), cd = _mm_unpacklo_epi8(cc, d);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm_unpacklo_epi16(ab, cd));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i + 16), _mm_unpackhi_epi16(ab, cd));
    }
  }
}

// Pack n32 (a multiple of 32) codes into a 6-, 4- or 2-bit stream (the scalar pack()'s bytes).
PPQ_ALWAYS_INLINE inline void pack32(const uint8_t* c, int64_t n32, int64_t bits, uint8_t* dst) {
  for (int64_t i = 0; i < n32; i += 32) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i));
    if (bits == 4) {  // 16-bit lane c0 | c1 << 8 -> byte c0 | c1 << 4
      const __m256i t = _mm256_and_si256(_mm256_or_si256(w, _mm256_srli_epi16(w, 4)), _mm256_set1_epi16(0xff));
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i / 2), _mm256_castsi256_si128(p));
    } else if (bits == 6) {  // 32-bit lane c0 | c1 << 8 | c2 << 16 | c3 << 24 -> 24 bits c0 | c1 << 6 | ..., 3 bytes
      const __m256i t16 = _mm256_maddubs_epi16(w, _mm256_set1_epi16(0x4001));      // c0 + 64 c1, c2 + 64 c3
      const __m256i t32 = _mm256_madd_epi16(t16, _mm256_set1_epi32(0x10000001));   // + 4096 (c2 + 64 c3)
      const __m256i squeeze = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                               0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
      const __m256i b = _mm256_shuffle_epi8(t32, squeeze);
      uint8_t* d = dst + i / 4 * 3;
      const __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(d), b0);
      const int32_t t0 = _mm_extract_epi32(b0, 2), t1 = _mm_extract_epi32(b1, 2);
      std::memcpy(d + 8, &t0, 4);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(d + 12), b1);
      std::memcpy(d + 20, &t1, 4);
    } else {  // 32-bit lane c0 | c1 << 8 | c2 << 16 | c3 << 24 -> byte c0 | c1 << 2 | c2 << 4 | c3 << 6
      const __m256i t16 = _mm256_maddubs_epi16(w, _mm256_set1_epi16(0x0401));      // c0 + 4 c1, c2 + 4 c3
      const __m256i t32 = _mm256_madd_epi16(t16, _mm256_set1_epi32(0x00100001));   // + 16 (c2 + 4 c3)
      const __m128i b = ppq::avx2::bytes16(t32, _mm256_setzero_si256());
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i / 4), b);
    }
  }
}

}  // namespace v2
#endif  // PPQ_HAS_AVX2

struct GroupStats {
  float mn, scale, inv, p, mnp;  // p: prescale (0.5 when the range overflows a float), mnp = mn * p
  bool bad;
};

template <typename T>
GroupStats minmax_stats(const T* x, int64_t n, int64_t levels) {
  float mn = INFINITY, mx = -INFINITY;
  bool nan = false;
  int64_t i0 = 0;
#if PPQ_HAS_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 8) {
      i0 = n & ~int64_t(7);
      v2::minmax8(x, i0, mn, mx, nan);
    }
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    float v = float(x[i]);
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    nan |= v != v;
  }
  GroupStats s;
  s.bad = nan || !std::isfinite(mn) || !std::isfinite(mx);
  if (nan) mn = mx = NAN;
  double rng = double(mx) - double(mn);
  s.mn = mn;
  s.scale = float(rng / double(levels));
  s.p = rng > double(FLT_MAX) ? 0.5f : 1.0f;
  s.mnp = mn * s.p;
  s.inv = rng > 0 ? float(double(levels) / (rng * double(s.p))) : 0.0f;
  return s;
}

// Codes of x[i0, i1) (flat), with i0 on a whole byte of the stream; stats[g] per group.
template <typename T>
void encode_span(const T* x, int64_t i0, int64_t i1, int64_t d, int64_t group, int64_t ng,
                 const GroupStats* stats, int64_t bits, uint8_t* codes) {
  const float lv = float((1 << bits) - 1);
  alignas(64) uint8_t buf[kSeg];
  for (int64_t s0 = i0; s0 < i1; s0 += kSeg) {
    int64_t s1 = std::min(i1, s0 + kSeg);
#if PPQ_HAS_AVX2
    if constexpr (std::is_same_v<T, float>) {  // one group over the whole segment, 4 or 2 bits: no buffer
      const int64_t r = s0 / d, c = s0 % d;
      if ((bits == 4 || bits == 2) && (s1 - s0) % 32 == 0 && s1 - r * d <= std::min(d, (c / group + 1) * group)) {
        const GroupStats& st = stats[r * ng + c / group];
        v2::minmax_codes_packed(x + s0, s1 - s0, st.p, st.mnp, st.inv, lv, bits, codes + s0 * bits / 8);
        continue;
      }
    }
#endif
    int64_t i = s0;
    while (i < s1) {  // runs of one group
      int64_t r = i / d, c = i % d;
      int64_t g = r * ng + c / group;
      int64_t end = std::min(s1, r * d + std::min(d, (c / group + 1) * group));
      const float mnp = stats[g].mnp, inv = stats[g].inv, p = stats[g].p;
      uint8_t* b = buf + (i - s0);
      const T* xp = x + i;
      int64_t j0 = 0;
#if PPQ_HAS_AVX2
      if constexpr (std::is_same_v<T, float>) {
        j0 = (end - i) & ~int64_t(31);
        v2::minmax_codes(xp, j0, p, mnp, inv, lv, b);
      }
#endif
      for (int64_t j = j0; j < end - i; ++j) {
        float t = (float(xp[j]) * p - mnp) * inv;
        t = t > 0.0f ? t : 0.0f;  // NaN -> 0
        t = t < lv ? t : lv;
        b[j] = uint8_t(int32_t(round_nonneg(t)));
      }
      i = end;
    }
#if PPQ_HAS_AVX2
    if (bits != 8) {
      const int64_t n32 = (s1 - s0) & ~int64_t(31);
      v2::pack32(buf, n32, bits, codes + s0 * bits / 8);
      pack(buf + n32, s1 - s0 - n32, bits, codes + (s0 + n32) * bits / 8);
      continue;
    }
#endif
    pack(buf, s1 - s0, bits, codes + s0 * bits / 8);
  }
}

void quant_encode(const at::Tensor& x, int64_t group, int64_t bits, at::Tensor mins, at::Tensor scales,
                  at::Tensor codes, at::Tensor status) {
  check_float_input(x, "x");
  check_bits(bits);
  TORCH_CHECK(x.dim() == 2, "x must be [R, d], got shape ", x.sizes());
  const int64_t R = x.size(0), d = x.size(1);
  TORCH_CHECK(group >= 1, "group must be >= 1, got ", group);
  const int64_t ng = (d + group - 1) / group, G = R * ng, n = R * d;
  check_buffer(mins, at::kFloat, G, "mins");
  check_buffer(scales, at::kFloat, G, "scales");
  check_buffer(codes, at::kByte, packed_nbytes(n, bits), "codes");
  check_buffer(status, at::kByte, 1, "status");
  const int64_t levels = (1 << bits) - 1;
  std::vector<GroupStats> st(G);
  float* mp = mins.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  int bad = 0;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const bool row_fused = d % pack_unit(bits) == 0;
    if (row_fused) {
#pragma omp parallel for reduction(| : bad) schedule(static)
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t g = 0; g < ng; ++g) {
          int64_t c0 = g * group, c1 = std::min(d, c0 + group);
          st[r * ng + g] = minmax_stats(xp + r * d + c0, c1 - c0, levels);
          bad |= st[r * ng + g].bad;
        }
        encode_span(xp, r * d, (r + 1) * d, d, group, ng, st.data(), bits, cp);
      }
    } else {
#pragma omp parallel for reduction(| : bad) schedule(static)
      for (int64_t g = 0; g < G; ++g) {
        int64_t r = g / ng, c0 = (g % ng) * group, c1 = std::min(d, c0 + group);
        st[g] = minmax_stats(xp + r * d + c0, c1 - c0, levels);
        bad |= st[g].bad;
      }
      const int64_t chunks = (n + kSeg - 1) / kSeg;
#pragma omp parallel for schedule(static)
      for (int64_t ch = 0; ch < chunks; ++ch)
        encode_span(xp, ch * kSeg, std::min(n, (ch + 1) * kSeg), d, group, ng, st.data(), bits, cp);
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    mp[g] = st[g].mn;
    sp[g] = st[g].scale;
  }
  status.data_ptr<uint8_t>()[0] = bad ? 1 : 0;
}

void quant_decode(const at::Tensor& codes, const at::Tensor& mins, const at::Tensor& scales, int64_t group,
                  int64_t bits, at::Tensor out) {
  check_float_input(out, "out");
  check_bits(bits);
  TORCH_CHECK(out.dim() == 2, "out must be [R, d], got shape ", out.sizes());
  const int64_t R = out.size(0), d = out.size(1);
  TORCH_CHECK(group >= 1, "group must be >= 1, got ", group);
  const int64_t ng = (d + group - 1) / group, n = R * d;
  check_buffer(mins, at::kFloat, R * ng, "mins");
  check_buffer(scales, at::kFloat, R * ng, "scales");
  check_buffer(codes, at::kByte, packed_nbytes(n, bits), "codes");
  const float* mp = mins.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t chunks = (n + kSeg - 1) / kSeg;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* op = out.data_ptr<scalar_t>();
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      alignas(64) uint8_t buf[kSeg];
      int64_t s0 = ch * kSeg, s1 = std::min(n, s0 + kSeg);
#if PPQ_HAS_AVX2
      if (bits != 8) {
        const int64_t n32 = (s1 - s0) & ~int64_t(31);
        v2::unpack32(cp + s0 * bits / 8, n32, bits, buf);
        unpack(cp + (s0 + n32) * bits / 8, s1 - s0 - n32, bits, buf + n32);
      } else {
        unpack(cp + s0 * bits / 8, s1 - s0, bits, buf);
      }
#else
      unpack(cp + s0 * bits / 8, s1 - s0, bits, buf);
#endif
      int64_t i = s0;
      while (i < s1) {
        int64_t r = i / d, c = i % d;
        int64_t g = r * ng + c / group;
        int64_t end = std::min(s1, r * d + std::min(d, (c / group + 1) * group));
        const float mn = mp[g], sc = sp[g];
        const uint8_t* b = buf + (i - s0);
        scalar_t* o = op + i;
        int64_t j0 = 0;
#if PPQ_HAS_AVX2
        if constexpr (v2::kVecOut<scalar_t>) {
          j0 = (end - i) & ~int64_t(7);
          v2::minmax_values(b, j0, sc, mn, o);
        }
#endif
        for (int64_t j = j0; j < end - i; ++j) o[j] = scalar_t(std::fma(float(b[j]), sc, mn));
        i = end;
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// FP8

// Clamp to [-fmax, fmax]; NaN passes through (std::max/min return their first argument on NaN).
inline float clamp_fp8(float y, float fmax) { return std::min(std::max(y, -fmax), fmax); }
inline uint32_t fbits(float f) { return fp8::bits(f); }

template <typename F8>
struct Fp8Lut {
  float v[256];
  Fp8Lut() {
    for (int i = 0; i < 256; ++i) v[i] = float(F8(uint8_t(i), F8::from_bits()));
  }
};

void fp8_encode(const at::Tensor& x, int64_t group, int64_t fmt, at::Tensor scales, at::Tensor codes,
                at::Tensor status) {
  check_float_input(x, "x");
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (e4m3) or 1 (e5m2), got ", fmt);
  TORCH_CHECK(x.dim() == 2, "x must be [R, d], got shape ", x.sizes());
  const int64_t R = x.size(0), d = x.size(1);
  TORCH_CHECK(group >= 1, "group must be >= 1, got ", group);
  const int64_t ng = (d + group - 1) / group, G = R * ng;
  check_buffer(scales, at::kFloat, G, "scales");
  check_buffer(codes, at::kByte, R * d, "codes");
  check_buffer(status, at::kByte, 1, "status");
  const float fmax = fmt == 0 ? 448.0f : 57344.0f;
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  int bad = 0;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
#pragma omp parallel for reduction(| : bad) schedule(static)
    for (int64_t g = 0; g < G; ++g) {
      int64_t r = g / ng, c0 = (g % ng) * group, n = std::min(d, c0 + group) - c0;
      const scalar_t* p = xp + r * d + c0;
      uint8_t* o = cp + r * d + c0;
      // amax as the integer max of |x|'s bits: finite non-negative floats order like their bits, and
      // NaN/Inf give bits >= 0x7f800000 (a NaN amax, as torch's amax, then gives scale 1 below).
      uint32_t m = 0;
      int64_t i0 = 0;
#if PPQ_HAS_AVX2
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (n >= 16) {
          i0 = n & ~int64_t(15);
          m = ppq::avx2::absmax_bits(p, i0);
        }
      }
#endif
      for (int64_t i = i0; i < n; ++i) m = std::max(m, fbits(float(p[i])) & 0x7fffffffu);
      const float amax = fp8::from_bits(m);
      bad |= m >= 0x7f800000u;
      double a = amax;
      sp[g] = a > 0 ? float(a / fmax) : 1.0f;
      const float inv = a > 0 ? float(double(fmax) / a) : 1.0f;
      // Locals only in the loops: a byte store may alias anything, so a value read through the lambda's
      // captures would be reloaded after every store and the loop would stay scalar.
      const float q = fmax;
      int64_t e0 = 0;
#if PPQ_HAS_AVX2
      if constexpr (std::is_same_v<scalar_t, float>) {
        e0 = n & ~int64_t(31);
        const __m256 vinv = _mm256_set1_ps(inv);
        auto enc = [&](auto e4m3) {
          auto code8 = [&](int64_t i) PPQ_ALWAYS_INLINE { return ppq::avx2::fp8_codes<decltype(e4m3)::value>(_mm256_mul_ps(_mm256_loadu_ps(p + i), vinv)); };
          for (int64_t i = 0; i < e0; i += 32) {
            v2::prefetch_ahead(p + i);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), ppq::avx2::bytes32(code8(i), code8(i + 8), code8(i + 16), code8(i + 24)));
          }
        };
        if (fmt == 0) enc(std::true_type{}); else enc(std::false_type{});
      }
#endif
      if (fmt == 0) {
        for (int64_t i = e0; i < n; ++i) o[i] = fp8::f32_to_e4m3(clamp_fp8(float(p[i]) * inv, q));
      } else {
        for (int64_t i = e0; i < n; ++i) o[i] = fp8::f32_to_e5m2(clamp_fp8(float(p[i]) * inv, q));
      }
    }
  });
  status.data_ptr<uint8_t>()[0] = bad ? 1 : 0;
}

void fp8_decode(const at::Tensor& codes, const at::Tensor& scales, int64_t group, int64_t fmt, at::Tensor out) {
  check_float_input(out, "out");
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (e4m3) or 1 (e5m2), got ", fmt);
  TORCH_CHECK(out.dim() == 2, "out must be [R, d], got shape ", out.sizes());
  const int64_t R = out.size(0), d = out.size(1);
  TORCH_CHECK(group >= 1, "group must be >= 1, got ", group);
  const int64_t ng = (d + group - 1) / group, G = R * ng;
  check_buffer(scales, at::kFloat, G, "scales");
  check_buffer(codes, at::kByte, R * d, "codes");
  static const Fp8Lut<c10::Float8_e4m3fn> lut_e4m3;
  static const Fp8Lut<c10::Float8_e5m2> lut_e5m2;
  const float* lut = fmt == 0 ? lut_e4m3.v : lut_e5m2.v;
  const float* sp = scales.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* op = out.data_ptr<scalar_t>();
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; ++g) {
      int64_t r = g / ng, c0 = (g % ng) * group, n = std::min(d, c0 + group) - c0;
      const uint8_t* c = cp + r * d + c0;
      scalar_t* o = op + r * d + c0;
      const float s = sp[g];
      int64_t i0 = 0;
#if PPQ_HAS_AVX2
      if constexpr (v2::kVecOut<scalar_t>) {
        i0 = n & ~int64_t(7);
        const __m256 vs = _mm256_set1_ps(s);
        for (int64_t i = 0; i < i0; i += 8) {
          const __m256i ci = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
          const __m256 v = fmt == 0 ? ppq::avx2::fp8_decode8<true>(ci) : ppq::avx2::fp8_decode8<false>(ci);
          v2::store8(o + i, _mm256_mul_ps(v, vs));
        }
      }
#endif
      for (int64_t i = i0; i < n; ++i) o[i] = scalar_t(lut[c[i]] * s);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// TopK per row

inline uint32_t abs_key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u & 0x7fffffffu;
}

// Per-thread scratch for the candidate indices (32-bit: rows are < 2^31 values).
inline std::vector<int32_t>& topk_scratch() {
  thread_local std::vector<int32_t> v;
  return v;
}

inline std::vector<uint32_t>& topk_scratch_bits() {  // the candidates' value bits
  thread_local std::vector<uint32_t> v;
  return v;
}

#if PPQ_HAS_AVX2
// Indices and value bits of every x[i] (i < L) whose key |x| bits are >= lo, in ascending order, into
// c32/cv (capacity L + 16); returns their count. 8 keys at a time (AVX2): compare, then left-pack the
// passing lanes with one permute (a table of the 256 masks' permutations) and advance by their count: no
// branch per element (a scalar loop mispredicts on ~10% random hits); AVX-512: 16 at a time, the
// left-pack by vpcompressd. *maxkey: the largest key seen.
inline int64_t compact_ge(const float* x, int64_t L, uint32_t lo, int32_t* c32, uint32_t* cv, uint32_t* maxkey) {
  static const auto kPack = [] {
    std::array<uint32_t, 256 * 8> t{};
    for (int mk = 0; mk < 256; ++mk) {
      int j = 0;
      for (int b = 0; b < 8; ++b)
        if (mk >> b & 1) t[mk * 8 + j++] = uint32_t(b);
    }
    return t;
  }();
  int64_t nc = 0, i = 0;
#if PPQ_ISA_AVX512
  {
    const __m512i vlo = _mm512_set1_epi32(int32_t(lo) - 1), mask = _mm512_set1_epi32(0x7fffffff);
    __m512i vi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), vmax = _mm512_setzero_si512();
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (; i + 16 <= L; i += 16) {
      const __m512i raw = _mm512_loadu_si512(x + i);
      const __m512i key = _mm512_and_si512(raw, mask);
      vmax = _mm512_max_epu32(vmax, key);
      const __mmask16 mk = _mm512_cmpgt_epi32_mask(key, vlo);  // key >= lo (< 2^31)
      _mm512_storeu_si512(c32 + nc, _mm512_maskz_compress_epi32(mk, vi));
      _mm512_storeu_si512(cv + nc, _mm512_maskz_compress_epi32(mk, raw));
      nc += __builtin_popcount(unsigned(mk));
      vi = _mm512_add_epi32(vi, sixteen);
    }
    uint32_t m = _mm512_reduce_max_epu32(vmax);
    for (; i < L; ++i) {
      const uint32_t raw = fp8::bits(x[i]), key = raw & 0x7fffffffu;
      m = std::max(m, key);
      if (key >= lo) c32[nc] = int32_t(i), cv[nc++] = raw;
    }
    *maxkey = m;
    return nc;
  }
#endif
  const __m256i vlo = _mm256_set1_epi32(int32_t(lo) - 1), mask = _mm256_set1_epi32(0x7fffffff);
  __m256i vi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vmax = _mm256_setzero_si256();
  const __m256i eight = _mm256_set1_epi32(8);
  for (; i + 8 <= L; i += 8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i key = _mm256_and_si256(raw, mask);
    vmax = _mm256_max_epu32(vmax, key);
    const int mk = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, vlo)));  // key >= lo (< 2^31)
    const __m256i perm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kPack.data() + mk * 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c32 + nc), _mm256_permutevar8x32_epi32(vi, perm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cv + nc), _mm256_permutevar8x32_epi32(raw, perm));
    nc += __builtin_popcount(unsigned(mk));
    vi = _mm256_add_epi32(vi, eight);
  }
  uint32_t m = ppq::avx2::hmax_epu32(vmax);
  for (; i < L; ++i) {
    const uint32_t raw = fp8::bits(x[i]), key = raw & 0x7fffffffu;
    m = std::max(m, key);
    if (key >= lo) c32[nc] = int32_t(i), cv[nc++] = raw;
  }
  *maxkey = m;
  return nc;
}

// The k largest |x| of a float row, from a sample: the keys of 64 spread chunks of the row give a bound
// lo that at least k values should clear (the sample's k-quantile, with a margin); one pass keeps the
// values >= lo with their indices, and the exact selection (histogram, threshold bin, ties to the lower
// index) runs on those candidates only. Exact whenever at least k values clear lo, which the pass
// counts; returns -1 otherwise (an unrepresentative sample: the caller runs the full histogram).
inline int topk_row_sampled(const float* x, int64_t L, int64_t k, int64_t* idx, float* vals,
                            std::vector<uint32_t>& hist) {
  constexpr int64_t kChunks = 64, kChunk = 256;
  std::fill(hist.begin(), hist.end(), 0u);
  uint32_t* h = hist.data();
  const int64_t stride = L / kChunks, S = kChunks * kChunk;
  for (int64_t c = 0; c < kChunks; ++c) {
    const float* p = x + c * stride;
    for (int64_t i = 0; i < kChunk; ++i) h[(fp8::bits(p[i]) & 0x7fffffffu) >> 15]++;
  }
  // the sample's count to clear: k's share plus a margin of ~4 standard deviations and 10%
  const double share = double(k) * double(S) / double(L);
  const int64_t want = int64_t(share * 1.1 + 4.0 * std::sqrt(share) + 16.0);
  if (want >= S) return -1;
  int64_t above = 0, tb = 65535;
  for (; tb > 0; --tb) {
    above += h[tb];
    if (above >= want) break;
  }
  std::vector<int32_t>& c32v = topk_scratch();
  std::vector<uint32_t>& cvv = topk_scratch_bits();
  c32v.resize(size_t(L) + 16);
  cvv.resize(size_t(L) + 16);
  // raw pointers: through the thread-local vectors, every cv[j] beside a push_back reloaded the vector
  // by a __tls_get_addr call (a quarter of the TopK's time, as profiled)
  int32_t* const c32 = c32v.data();
  uint32_t* const cv = cvv.data();
  uint32_t maxkey = 0;
  const int64_t nc = compact_ge(x, L, uint32_t(tb) << 15, c32, cv, &maxkey);
  if (nc < k) return -1;
  // exact selection among the candidates: histogram of their keys, the threshold bin, its k-th key. The
  // candidates' bins run from tb to maxkey's, a few hundred: two interleaved histograms of that span
  // stay in L1 and halve the chains of increments to one bin.
  const int64_t span = int64_t(std::min<uint32_t>(maxkey, 0x7fffffffu) >> 15) - tb + 1;
  if (hist.size() < size_t(2 * span)) hist.resize(size_t(2 * span));  // NaN/Inf: span up to 65536 bins
  h = hist.data();
  std::fill(hist.begin(), hist.begin() + 2 * span, 0u);
  {
    uint32_t* h0 = h - tb;
    uint32_t* h1 = h + span - tb;
    int64_t j = 0;
    for (; j + 2 <= nc; j += 2) {
      h0[(cv[j] & 0x7fffffffu) >> 15]++;
      h1[(cv[j + 1] & 0x7fffffffu) >> 15]++;
    }
    if (j < nc) h0[(cv[j] & 0x7fffffffu) >> 15]++;
  }
  int64_t above2 = 0, tb2 = tb + span - 1;  // a bin index; its count is h[b - tb] + h[span + b - tb]
  auto count = [&](int64_t b) { return int64_t(h[b - tb]) + int64_t(h[span + b - tb]); };
  for (; tb2 > tb; --tb2) {
    if (above2 + count(tb2) >= k) break;
    above2 += count(tb2);
  }
  // the threshold bin's keys, branch-free (one store per candidate, the count advanced on a hit)
  std::vector<uint32_t> keys(size_t(count(tb2)) + 1);
  {
    uint32_t* kp = keys.data();
    int64_t n = 0;
    for (int64_t j = 0; j < nc; ++j) {
      const uint32_t key = cv[j] & 0x7fffffffu;
      kp[n] = key;
      n += (key >> 15) == uint32_t(tb2);
    }
    keys.resize(size_t(n));
  }
  const int64_t need = k - above2;
  std::nth_element(keys.begin(), keys.begin() + (need - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t T_ = keys[need - 1];
  int64_t greater = above2;
  for (uint32_t key : keys) greater += key > T_;
  int64_t ties = k - greater, o = 0, j = 0;
  int64_t equal = 0;  // keys == T_ among the candidates
  for (uint32_t key : keys) equal += key == T_;
  if (equal == ties) {  // every key >= T_ is taken (the usual case): left-pack them 8 at a time
    static const auto kPack = [] {
      std::array<uint32_t, 256 * 8> t{};
      for (int mk = 0; mk < 256; ++mk) {
        int q = 0;
        for (int b = 0; b < 8; ++b)
          if (mk >> b & 1) t[mk * 8 + q++] = uint32_t(b);
      }
      return t;
    }();
    const __m256i vt = _mm256_set1_epi32(int32_t(T_) - 1), mask = _mm256_set1_epi32(0x7fffffff);
    for (; j + 8 <= nc && o + 8 <= k; j += 8) {  // stores of 8 stay inside the k outputs
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cv + j));
      const int mk = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_and_si256(raw, mask), vt)));
      const __m256i perm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kPack.data() + mk * 8));
      const __m256i ix = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c32 + j)), perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vals + o), _mm256_permutevar8x32_epi32(raw, perm));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + o), _mm256_cvtepi32_epi64(_mm256_castsi256_si128(ix)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + o + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(ix, 1)));
      const int taken = __builtin_popcount(unsigned(mk));
      o += taken;
    }
    ties = 0;  // the scalar loop below takes every key >= T_ that is left
    for (; j < nc; ++j) {
      const uint32_t key = cv[j] & 0x7fffffffu;
      if (key >= T_) {
        idx[o] = c32[j];
        vals[o++] = fp8::from_bits(cv[j]);
      }
    }
  } else {
    for (; j < nc; ++j) {
      const uint32_t key = cv[j] & 0x7fffffffu;
      const bool take = key > T_ || (key == T_ && ties > 0);
      ties -= key == T_ && take;
      if (take) {
        idx[o] = c32[j];
        vals[o++] = fp8::from_bits(cv[j]);
      }
    }
  }
  TORCH_INTERNAL_ASSERT(o == k, "topk selected ", o, " of ", k);
  return maxkey >= 0x7f800000u ? 1 : 0;
}
#endif

template <typename T>
bool topk_row(const T* x, int64_t L, int64_t k, int64_t* idx, T* vals, std::vector<uint32_t>& hist,
              std::vector<int64_t>& cand) {
#if PPQ_HAS_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (L >= (int64_t(1) << 16) && L < (int64_t(1) << 31) - 16) {
      const int r = topk_row_sampled(x, L, k, idx, vals, hist);
      if (r >= 0) return r == 1;
    }
  }
#endif
  // Pass 1: histogram of the top 16 bits of the key (bit 31 is always 0).
  std::fill(hist.begin(), hist.end(), 0u);
  uint32_t* h = hist.data();
  bool bad = false;
  for (int64_t i = 0; i < L; ++i) {
    uint32_t key = abs_key(float(x[i]));
    bad |= key >= 0x7f800000u;
    h[key >> 15]++;
  }
  int64_t above = 0;  // elements in bins strictly above the threshold bin
  int64_t tb = 65535;
  for (; tb >= 0; --tb) {
    if (above + h[tb] >= k) break;
    above += h[tb];
  }
  // Pass 2: every index whose bin is >= tb, in ascending order.
  cand.clear();
  const uint32_t lo = uint32_t(tb) << 15;
  int64_t i2 = 0;
#if PPQ_HAS_AVX2
  if constexpr (std::is_same_v<T, float>) if (L < (int64_t(1) << 31) - 16) {
    std::vector<int32_t>& c32v = topk_scratch();
    std::vector<uint32_t>& cvv = topk_scratch_bits();
    c32v.resize(size_t(L) + 16);
    cvv.resize(size_t(L) + 16);
    int32_t* const c32 = c32v.data();  // raw pointers, as in topk_row_sampled
    uint32_t* const cv = cvv.data();
    uint32_t maxkey = 0;
    const int64_t nc = compact_ge(x, L, lo, c32, cv, &maxkey);
    // The rest runs on the compact candidate arrays (index, value bits) instead of re-reading x.
    std::vector<uint32_t> keys;
    keys.reserve(h[tb]);
    for (int64_t j = 0; j < nc; ++j) {
      const uint32_t key = cv[j] & 0x7fffffffu;
      if ((key >> 15) == uint32_t(tb)) keys.push_back(key);
    }
    const int64_t need = k - above;
    std::nth_element(keys.begin(), keys.begin() + (need - 1), keys.end(), std::greater<uint32_t>());
    const uint32_t T_ = keys[need - 1];
    int64_t greater = above;
    for (uint32_t key : keys) greater += key > T_;
    int64_t ties = k - greater, o = 0;
    for (int64_t j = 0; j < nc; ++j) {
      const uint32_t key = cv[j] & 0x7fffffffu;
      const bool take = key > T_ || (key == T_ && ties > 0);
      ties -= key == T_ && take;
      if (take) {
        idx[o] = c32[j];
        vals[o++] = fp8::from_bits(cv[j]);
      }
    }
    TORCH_INTERNAL_ASSERT(o == k, "topk selected ", o, " of ", k);
    return bad;
  }
#endif
  for (int64_t i = i2; i < L; ++i)
    if (abs_key(float(x[i])) >= lo) cand.push_back(i);
  // The exact K-th largest key, among the threshold bin's members.
  std::vector<uint32_t> keys;
  keys.reserve(h[tb]);
  for (int64_t i : cand) {
    uint32_t key = abs_key(float(x[i]));
    if ((key >> 15) == uint32_t(tb)) keys.push_back(key);
  }
  int64_t need = k - above;  // how many of the threshold bin are taken
  std::nth_element(keys.begin(), keys.begin() + (need - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t T_ = keys[need - 1];
  int64_t greater = above;
  for (uint32_t key : keys) greater += key > T_;
  int64_t ties = k - greater;  // keys equal to T_ taken, lowest indices first
  int64_t j = 0;
  for (int64_t i : cand) {
    uint32_t key = abs_key(float(x[i]));
    if (key > T_) {
      idx[j++] = i;
    } else if (key == T_ && ties > 0) {
      idx[j++] = i;
      --ties;
    }
  }
  TORCH_INTERNAL_ASSERT(j == k, "topk selected ", j, " of ", k);
  for (int64_t o = 0; o < k; ++o) vals[o] = x[idx[o]];
  return bad;
}

void topk_encode(const at::Tensor& x, int64_t k, at::Tensor values, at::Tensor indices, at::Tensor status) {
  check_float_input(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [B, L], got shape ", x.sizes());
  const int64_t B = x.size(0), L = x.size(1);
  TORCH_CHECK(k >= 1 && k <= L, "k must be in [1, L=", L, "], got ", k);
  check_buffer(values, x.scalar_type(), B * k, "values");
  check_buffer(indices, at::kLong, B * k, "indices");
  check_buffer(status, at::kByte, 1, "status");
  int64_t* ip = indices.data_ptr<int64_t>();
  int bad = 0;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* vp = values.data_ptr<scalar_t>();
#pragma omp parallel reduction(| : bad)
    {
      std::vector<uint32_t> hist(65536);
      std::vector<int64_t> cand;
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < B; ++b) {
        bad |= topk_row(xp + b * L, L, k, ip + b * k, vp + b * k, hist, cand);
      }
    }
  });
  status.data_ptr<uint8_t>()[0] = bad ? 1 : 0;
}

void topk_decode(const at::Tensor& values, const at::Tensor& indices, at::Tensor out) {
  check_float_input(out, "out");
  TORCH_CHECK(out.dim() == 2, "out must be [B, L], got shape ", out.sizes());
  const int64_t B = out.size(0), L = out.size(1);
  TORCH_CHECK(indices.dim() == 2 && indices.size(0) == B, "indices must be [B=", B, ", K], got ", indices.sizes());
  const int64_t k = indices.size(1);
  check_buffer(indices, at::kLong, B * k, "indices");
  check_buffer(values, out.scalar_type(), B * k, "values");
  const int64_t* ip = indices.data_ptr<int64_t>();
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* vp = values.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    int bad_idx = 0;
#pragma omp parallel for reduction(| : bad_idx) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      std::memset(op + b * L, 0, L * sizeof(scalar_t));
      for (int64_t j = 0; j < k; ++j) {
        int64_t i = ip[b * k + j];
        if (i < 0 || i >= L) {
          bad_idx = 1;
          continue;
        }
        op[b * L + i] = vp[b * k + j];
      }
    }
    TORCH_CHECK(!bad_idx, "indices must lie in [0, L=", L, ")");
  });
}

// ------------------------------------------------------------------------------------------------
// Bit packing (little-endian bit stream, `bits` bits per value)

// The 8 values of one block into its `B` bytes, the bit writer unrolled at compile time: every shift and
// store offset is a constant.
template <int B, int J = 0, int NACC = 0, int W = 0>
PPQ_ALWAYS_INLINE inline void pack_block(const int64_t* ip, uint8_t* dst, uint64_t acc) {
  if constexpr (J == 8) {
    static_assert(NACC == 8 * (B - W));
    if constexpr (W < B) std::memcpy(dst + W, &acc, size_t(B - W));  // little-endian: the low bytes
  } else {
    const uint64_t v = uint64_t(ip[J]) & ((uint64_t(1) << B) - 1);
    acc |= v << NACC;
    if constexpr (NACC + B >= 64) {  // B <= 56, so NACC > 0 here
      std::memcpy(dst + W, &acc, 8);
      pack_block<B, J + 1, NACC + B - 64, W + 8>(ip, dst, (v >> (63 - NACC)) >> 1);
    } else {
      pack_block<B, J + 1, NACC + B, W>(ip, dst, acc);
    }
  }
}
template <int B>
void pack_blocks(const int64_t* ip, int64_t blocks, uint8_t* dst) {
  for (int64_t blk = 0; blk < blocks; ++blk) pack_block<B>(ip + 8 * blk, dst + B * blk, 0);
}
using PackBlocksFn = void (*)(const int64_t*, int64_t, uint8_t*);
template <int... B>
constexpr std::array<PackBlocksFn, sizeof...(B)> pack_blocks_table(std::integer_sequence<int, B...>) {
  return {&pack_blocks<B + 1>...};
}
constexpr auto kPackBlocks = pack_blocks_table(std::make_integer_sequence<int, 56>{});  // bits 1..56

void pack_bits(const at::Tensor& idx, int64_t bits, at::Tensor out) {
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous(), "idx must be contiguous int64");
  TORCH_CHECK(bits >= 1 && bits <= 56, "bits must be in [1, 56], got ", bits);
  const int64_t n = idx.numel();
  check_buffer(out, at::kByte, packed_nbytes(n, bits), "out");
  const int64_t* ip = idx.data_ptr<int64_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t whole = n / 8;  // whole blocks: 8 values = `bits` whole bytes
  const PackBlocksFn fn = kPackBlocks[bits - 1];
  constexpr int64_t kChunk = 4096;  // blocks per task
#pragma omp parallel for schedule(static)
  for (int64_t b0 = 0; b0 < whole; b0 += kChunk)
    fn(ip + 8 * b0, std::min(kChunk, whole - b0), op + bits * b0);
  // the tail: fewer than 8 values
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  const int64_t nbytes = packed_nbytes(n, bits);
  uint64_t acc = 0;
  int nacc = 0;
  int64_t w = whole * bits;
  for (int64_t i = whole * 8; i < n; ++i) {
    acc |= (uint64_t(ip[i]) & mask) << nacc;
    nacc += int(bits);
    while (nacc >= 8) {
      op[w++] = acc & 255;
      acc >>= 8;
      nacc -= 8;
    }
  }
  if (w < nbytes) op[w++] = acc & 255;
}

// The 8 values of whole blocks from their `B` bytes each, every shift and offset a compile-time constant
// (pack_blocks' counterpart): value j is one unaligned 64-bit read at byte j * B / 8, shifted by
// (j * B) % 8 and masked. The reads run up to 7 bytes past a block, so the caller leaves the blocks at the
// stream's end to the generic loop.
template <int B>
void unpack_blocks(const uint8_t* src, int64_t blocks, int64_t* op) {
  constexpr uint64_t mask = (uint64_t(1) << B) - 1;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* s = src + B * blk;
    int64_t* o = op + 8 * blk;
    [&]<int... J>(std::integer_sequence<int, J...>) PPQ_ALWAYS_INLINE {
      ((o[J] = [&] {
         uint64_t cur;
         std::memcpy(&cur, s + (J * B) / 8, 8);
         return int64_t((cur >> ((J * B) % 8)) & mask);
       }()), ...);
    }(std::make_integer_sequence<int, 8>{});
  }
}
using UnpackBlocksFn = void (*)(const uint8_t*, int64_t, int64_t*);
template <int... B>
constexpr std::array<UnpackBlocksFn, sizeof...(B)> unpack_blocks_table(std::integer_sequence<int, B...>) {
  return {&unpack_blocks<B + 1>...};
}
constexpr auto kUnpackBlocks = unpack_blocks_table(std::make_integer_sequence<int, 56>{});  // bits 1..56

void unpack_bits(const at::Tensor& packed, int64_t bits, at::Tensor out) {
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous(), "out must be contiguous int64");
  TORCH_CHECK(bits >= 1 && bits <= 56, "bits must be in [1, 56], got ", bits);
  const int64_t n = out.numel();
  check_buffer(packed, at::kByte, packed_nbytes(n, bits), "packed");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t blocks = (n + 7) / 8, total = packed_nbytes(n, bits);
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  // whole blocks whose 64-bit reads stay inside the stream: (blk + 1) * bits + 8 <= total
  const int64_t fast = std::clamp<int64_t>((total - 8) / bits - 1, 0, n / 8);
  const UnpackBlocksFn fn = kUnpackBlocks[bits - 1];
  constexpr int64_t kChunk = 4096;  // blocks per task
#pragma omp parallel for schedule(static)
  for (int64_t b0 = 0; b0 < fast; b0 += kChunk) fn(pp + bits * b0, std::min(kChunk, fast - b0), op + 8 * b0);
  for (int64_t blk = fast; blk < blocks; ++blk) {  // the stream's last blocks: through a padded copy
    int64_t i0 = blk * 8, i1 = std::min(n, i0 + 8);
    const uint8_t* src = pp + blk * bits;
    if (i1 - i0 == 8) {
      alignas(8) uint8_t buf[64] = {};
      std::memcpy(buf, src, size_t(bits));
      for (int j = 0; j < 8; ++j) {
        const int64_t pos = j * bits;
        uint64_t cur;
        std::memcpy(&cur, buf + pos / 8, 8);
        op[i0 + j] = int64_t((cur >> (pos & 7)) & mask);
      }
      continue;
    }
    int64_t nbytes = packed_nbytes(i1 - i0, bits);
    uint64_t acc = 0;
    int nacc = 0;
    int64_t r = 0;
    for (int64_t i = i0; i < i1; ++i) {
      while (nacc < bits && r < nbytes) {
        acc |= uint64_t(src[r++]) << nacc;
        nacc += 8;
      }
      op[i] = int64_t(acc & mask);
      acc >>= bits;
      nacc -= int(bits);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CPU, m) {
  m.impl("quant_encode", &quant_encode);
  m.impl("quant_decode", &quant_decode);
  m.impl("fp8_encode", &fp8_encode);
  m.impl("fp8_decode", &fp8_decode);
  m.impl("topk_encode", &topk_encode);
  m.impl("topk_decode", &topk_decode);
  m.impl("pack_bits", &pack_bits);
  m.impl("unpack_bits", &unpack_bits);
}
