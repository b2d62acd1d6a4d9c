// Blockwise low-bit weight formats (int8, int4, nf4, fp8 e4m3/e5m2): quantize and dequantize on CPU.
//
// Design note.
// * The math is the one written in deepspeed_ppq/quant/ops.py, bit for bit: absmax per block over the
//   flattened tensor (last block may be partial), stored scale s = absmax / Q rounded to fp32/bf16,
//   codes computed against the stored scale. Tests compare codes with the reference exactly.
// * One pass over memory. A block (<= 4096 values, <= 16 KiB fp32) is read once from DRAM; the absmax
//   loop and the encode loop then run on L1-resident data. Blocks are independent, so OpenMP splits
//   them statically across torch's thread count (one contiguous range of blocks, one stream, per thread).
//   The encode loops prefetch the input 4096 values ahead (kAhead): only the absmax loop reads memory,
//   and without the prefetch the encode's time added to the read's (with it, AVX2 1-thread fp32 quantize
//   went from 0.54-0.61x a copy's bandwidth to 0.81-0.93x for int8, int4 and fp8, NF4 0.38 -> 0.6).
// * Per ISA (isa.h): full blocks (all but a partial last one; a multiple of 16 values) take explicit
//   AVX-512 or AVX2 loops (namespace avx, one per module, same names) that read fp32 or bf16 straight
//   from the input, bf16 widened in-register.
//   The partial last block, and every block in the scalar module, takes the scalar loops, bf16 widened
//   into a stack buffer first. Both give the same bits: the tests compare each path with the reference
//   (tests/ops/test_cpu_isa.py runs them on every path the CPU has), partial last blocks included. (GCC's
//   own vectorisation of the scalar loops spilled mask registers and ran at about one value per cycle,
//   which left the bf16 quantizers at 0.2-0.3x a copy.)
// * absmax is a max over the integer bits of |x| (finite, non-negative floats order like their bits, and
//   NaN/Inf show up as bits >= 0x7f800000, which marks the block's scale NaN: no extra pass for the
//   non-finite check); short blocks reduce 16 at a time through one transposing tree, and the scales
//   of a chunk of blocks are computed in one vector loop. int rounding is clamp-then-round-half-even;
//   fp8 encode lets the FPU round (add a power-of-two magic, see fp8_codes), fp8 decode is arithmetic on
//   the bits (torch's fp8->fp32 cast is a scalar loop); the scalar forms are shared with the other
//   kernels in fp8.h. NF4 encodes by a 32-bin table plus one compare (AVX2: a binary search), and
//   decodes with a 16-entry permute (AVX2 bf16 out: byte shuffles).
// * Quantize works on chunks, not blocks: the absmax of 8 (AVX2) or 16 (AVX-512) blocks at a time
//   through one transposing reduction, then one encode loop over the chunk's full blocks with each
//   block's multiplier broadcast from an array (encode_full_run), the next chunk prefetched. At 64 values
//   per block, the per-block call, format switch and constant set-up had cost about as much as the
//   encoding (AVX-512, Zen 5, fp32 in: int4 and NF4 0.50 -> 0.67-0.69x copy, fp8 0.42-0.52 -> 0.74-0.77
//   with the run loop). fp8 runs whose blocks are all finite skip the NaN select; int4 and NF4 runs
//   whose blocks are finite with normal (or zero) scales skip the clamp (AVX-512: |x / s| stays within
//   Q (1 + 2^-8) even with a bf16 scale, so int4 rounds into [-7, 7] and takes both +8s of a byte in
//   one add, and NF4's bin is one add and a truncation, kHalfBins).
// * AVX2 bf16 out: fp8 decodes 16 codes per vector in 16-bit lanes with no float arithmetic per value.
//   bf16(value * s) depends on a normal code's exponent only through a power of two, so per block two
//   8-word tables (bf16 of the mantissas at the bias exponent, and of the subnormal codes, times s) are
//   looked up by byte shuffles and the code's exponent is added to the word's exponent field; exact while
//   every result stays a normal bf16 (s in [2^-120, 2^119) for e4m3), else the general decode (an fp32
//   multiply and rounding per value, which had held FP8 at 0.35x a copy). int8 with a finite scale never
//   makes a NaN: it rounds to bf16 in integer lanes and packs words unmasked, with no NaN select.
//   int4/NF4 tables are built with two vector multiplies per block.
// * Outputs go into caller-provided buffers (`*_out` ops); the allocating ops allocate and call them.
// * bf16 out: round-to-nearest-even of the fp32 product, as torch's .to(bfloat16).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include "avx2.h"
#include "avx512.h"
#include "common/formats_torch.h"
#include "fp8.h"
#include "isa.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
#include <immintrin.h>
// GCC 12 reports the _mm512_undefined_*() placeholders inside the intrinsics as maybe-uninitialized
// once they are inlined into OpenMP-outlined functions: a known false positive (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

// The formats, their Q, packing, names and code dtypes: the table in common/formats.h (generated from
// deepspeed_ppq/formats.py) and common/formats_torch.h.
using ppq::formats::code_type;
using ppq::formats::Fmt;
using ppq::formats::packed4;
using ppq::formats::per_tensor_scale;
using ppq::formats::qmax;

constexpr float kNF4[16] = {PPQ_CODE_MAP_NF4};

struct Mid {
  float v[15];
  constexpr Mid() : v{} {
    for (int i = 0; i < 15; ++i) v[i] = (kNF4[i] + kNF4[i + 1]) / 2.0f;
  }
};
constexpr Mid kMid{};

Fmt parse_fmt(std::string_view f) { return ppq::formats::parse_or_throw(f); }

inline uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float from_bits(uint32_t u) { return std::bit_cast<float>(u); }
inline float bf16_to_f32(uint16_t h) { return from_bits(uint32_t(h) << 16); }
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u = bits(f);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(r);
}

// fp32 <-> fp8 bits: the shared branch-free conversions (fp8.h; c10's values, vectorisable).
using ppq::fp8::e4m3_to_f32;
using ppq::fp8::e5m2_to_f32;
using ppq::fp8::f32_to_e4m3;
using ppq::fp8::f32_to_e5m2;

// Round to nearest even for |y| <= 2^22 (callers clamp to +-127 first).
inline float rne(float y) {
  constexpr float magic = 12582912.0f;  // 1.5 * 2^23
  return (y + magic) - magic;
}

inline int threads() { return std::max(1, at::get_num_threads()); }

// NF4 encode by table instead of search: split [-1, 1] into 32 bins of width 1/16. Adjacent NF4
// midpoints are >= 0.08 apart, so a bin holds at most one; the code of y (the count of midpoints < y)
// is then base[bin] (midpoints below the bin) + (y > the bin's midpoint, +inf if none). The kernel
// works on 16 y = x * (16 / s) (exact: a power-of-two scale commutes with rounding), so bin =
// floor(16 y) + 16 and the comparison is against 16 * midpoint: the codes are the search's, bit for bit.
struct NF4Bins {
  int32_t base[32];
  float mid16[32];  // 16 x the bin's midpoint
  constexpr NF4Bins() : base{}, mid16{} {
    for (int j = 0; j < 32; ++j) {
      const float lo = -1.0f + j / 16.0f, hi = lo + 1.0f / 16.0f;
      mid16[j] = INFINITY;
      for (int i = 0; i < 15; ++i) {
        if (kMid.v[i] < lo) base[j] += 1;
        if (kMid.v[i] >= lo && kMid.v[i] < hi) {
          if (mid16[j] != INFINITY) throw "two NF4 midpoints in one bin";  // fails the constant evaluation
          mid16[j] = 16.0f * kMid.v[i];
        }
      }
    }
  }
};
constexpr NF4Bins kBins{};
// The bins of the AVX-512 encode of runs whose 16 y are known to lie within +-16.5 (finite values and a
// normal or zero scale: |y| <= 1 + 2^-8 even with a bf16 scale): bin j = the truncation of
// t = fl(16 y + 15.5), [j - 15.5, j - 14.5) with bin 0 open below and bin 31 above, so one add and one
// truncating conversion give an index in [0, 31] with no clamp (t > -1 truncates to 0; t < 32). t is
// rounded (by <= 2^-20), so a value that close to an edge may land in the bin beside it; its code is
// still the search's, since no midpoint lies within 2^-16 of an edge (checked here).
struct NF4HalfBins {
  int32_t base[32];
  float mid16[32];
  constexpr NF4HalfBins() : base{}, mid16{} {
    for (int j = 0; j < 32; ++j) {
      const float lo = j == 0 ? -INFINITY : j - 15.5f, hi = j == 31 ? INFINITY : j - 14.5f;
      mid16[j] = INFINITY;
      for (int i = 0; i < 15; ++i) {
        const float m = 16.0f * kMid.v[i];
        if (m < lo) base[j] += 1;
        if (m >= lo && m < hi) {
          if (mid16[j] != INFINITY) throw "two NF4 midpoints in one bin";  // fails the constant evaluation
          mid16[j] = m;
        }
        if (j > 0 && m - lo < 0x1p-16f && lo - m < 0x1p-16f) throw "an NF4 midpoint at a bin edge";
      }
    }
  }
};
constexpr NF4HalfBins kHalfBins{};
// 16 x the 15 NF4 midpoints, in order (the AVX2 binary search).
struct NF4Mid16 {
  float v[15];
  constexpr NF4Mid16() : v{} {
    for (int i = 0; i < 15; ++i) v[i] = 16.0f * kMid.v[i];
  }
};
constexpr NF4Mid16 kNF4Mid16{};
constexpr const float* kBins16 = kNF4Mid16.v;

// ---- per-block pieces ---------------------------------------------------------------------
template <bool BF16, typename In>
inline const float* load_block(const In* x, int64_t start, int64_t len, float* buf) {
  if constexpr (BF16) {
    const uint16_t* p = x + start;
    for (int64_t i = 0; i < len; ++i) buf[i] = bf16_to_f32(p[i]);
    return buf;
  } else {
    return x + start;
  }
}

// Bits of max |v| (>= 0x7f800000 when the block holds NaN or Inf).
inline uint32_t absmax_bits(const float* v, int64_t len) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    uint32_t a = bits(v[i]) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m;
}

// absmax bits -> the stored scale (rounded to the scale dtype), as fp32. NaN marks a bad block.
inline float make_scale(uint32_t m, Fmt f, bool bf16_scale) {
  float s = m >= 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : from_bits(m) / qmax(f);
  return bf16_scale ? bf16_to_f32(f32_to_bf16(s)) : s;
}

inline float inv_scale(float s) {
  return s > 0.0f ? std::min(1.0f / s, std::numeric_limits<float>::max()) : 0.0f;
}

// Encode one block of len values against scale s. `codes` points at the block's first code byte.
void encode_block(const float* v, int64_t len, Fmt f, float s, bool tail, uint8_t* codes) {
  const float inv = inv_scale(s);
  if (f == Fmt::I8) {
    int8_t* q = reinterpret_cast<int8_t*>(codes);
    for (int64_t i = 0; i < len; ++i) {
      float y = v[i] * inv;
      y = y < -127.0f ? -127.0f : y;
      y = y > 127.0f ? 127.0f : y;
      q[i] = int8_t(rne(y));
    }
  } else if (f == Fmt::E4M3 || f == Fmt::E5M2) {
    const float Q = qmax(f);
    auto clamp = [Q](float y) {
      y = y < -Q ? -Q : y;
      return y > Q ? Q : y;
    };
    if (f == Fmt::E4M3) {
      for (int64_t i = 0; i < len; ++i) codes[i] = f32_to_e4m3(clamp(v[i] * inv));
    } else {
      for (int64_t i = 0; i < len; ++i) codes[i] = f32_to_e5m2(clamp(v[i] * inv));
    }
  } else {
    alignas(64) uint8_t nib[4096 + 1];
    if (f == Fmt::I4) {
      for (int64_t i = 0; i < len; ++i) {
        float y = v[i] * inv;
        y = y < -7.0f ? -7.0f : y;
        y = y > 7.0f ? 7.0f : y;
        nib[i] = uint8_t(int(rne(y)) + 8);
      }
      nib[len] = 8;
    } else {  // NF4, bitsandbytes' rule: multiply by 1/max(s,1e-38); the partial last block divides.
      const float sc = std::max(s, 1e-38f);
      const float r = 1.0f / sc;
      auto code = [](float y) {
        y = y < -1.0f ? -1.0f : y;
        y = y > 1.0f ? 1.0f : y;
        int k = 0;
        for (int j = 0; j < 15; ++j) k += __builtin_isless(kMid.v[j], y);  // quiet compare: vectorises
        return uint8_t(k);
      };
      if (tail) {
        for (int64_t i = 0; i < len; ++i) nib[i] = code(v[i] / sc);
      } else {
        for (int64_t i = 0; i < len; ++i) nib[i] = code(v[i] * r);
      }
      nib[len] = 7;
    }
    const int64_t np = (len + 1) / 2;
    for (int64_t i = 0; i < np; ++i) codes[i] = uint8_t((nib[2 * i] << 4) | nib[2 * i + 1]);
  }
}

template <typename Out>
inline void store(Out* o, int64_t i, float v) {
  if constexpr (std::is_same_v<Out, float>) {
    o[i] = v;
  } else {
    o[i] = f32_to_bf16(v);
  }
}

#if PPQ_ISA_AVX512
inline void store16(float* o, __m512 x) { _mm512_storeu_ps(o, x); }
// 16 x fp32 -> bf16 bits in the low half of each 32-bit lane, round to nearest even as f32_to_bf16, for
// values that are not NaN (store16 adds the NaN select).
inline __m512i bf16_bits16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
}
inline void store16(uint16_t* o, __m512 x) {  // 16 x fp32 -> bf16, round to nearest even as f32_to_bf16
  __m512i r = bf16_bits16(x);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}
#endif

// Decode one block: `codes` at the block's first code byte, `o` at its first output value.
template <typename Out>
void decode_block(const uint8_t* codes, int64_t len, Fmt f, float s, Out* o) {
  switch (f) {
    case Fmt::I8: {
      const int8_t* q = reinterpret_cast<const int8_t*>(codes);
      for (int64_t i = 0; i < len; ++i) store(o, i, float(q[i]) * s);
      break;
    }
    case Fmt::E4M3:
      for (int64_t i = 0; i < len; ++i) store(o, i, e4m3_to_f32(codes[i]) * s);
      break;
    case Fmt::E5M2:
      for (int64_t i = 0; i < len; ++i) store(o, i, e5m2_to_f32(codes[i]) * s);
      break;
    case Fmt::I4: {
      const int64_t np = len / 2;
      for (int64_t i = 0; i < np; ++i) {
        uint8_t c = codes[i];
        store(o, 2 * i, float(int(c >> 4) - 8) * s);
        store(o, 2 * i + 1, float(int(c & 15) - 8) * s);
      }
      if (len & 1) store(o, len - 1, float(int(codes[np] >> 4) - 8) * s);
      break;
    }
    case Fmt::NF4: {
      alignas(64) float lut[16];
      for (int k = 0; k < 16; ++k) lut[k] = kNF4[k] * s;
      const int64_t np = len / 2;
      for (int64_t i = 0; i < np; ++i) {
        uint8_t c = codes[i];
        store(o, 2 * i, lut[c >> 4]);
        store(o, 2 * i + 1, lut[c & 15]);
      }
      if (len & 1) store(o, len - 1, lut[codes[np] >> 4]);
      break;
    }
  }
}

#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
// How far ahead of the encode loop the input is prefetched: 4096 values (16 KiB of fp32, 8 KiB of
// bf16: four and eight chunks). One chunk ahead had left the loop waiting on DRAM. Measured on a Zen 5
// core, 16M values: AVX-512 fp32 in int4 2.66 -> 1.69-1.95 ms, int8 2.56 -> 1.90, bf16 in int4 1.95 ->
// 1.72; forced AVX2 fp32 in int4 2.91 -> 2.29. 16 KiB of bf16 ahead slowed AVX2 bf16 in int8 (1.89 ->
// 2.2 ms); 8 KiB of fp32 gained less (int4 2.10).
constexpr int64_t kAhead = 4096;

// The fp32 values of an fp8 format's codes (bias, m) and (0, m), m = 0..7 (e5m2: m & 3): the bf16-out
// decode's per-block tables are these times the scale.
struct Fp8Mantissas {
  alignas(32) float normal[8];
  alignas(32) float subnormal[8];
  explicit Fp8Mantissas(bool e4) {
    const int mbits = e4 ? 3 : 2, bias = e4 ? 7 : 15;
    for (int m = 0; m < 8; ++m) {
      const int mm = m & ((1 << mbits) - 1);
      normal[m] = e4 ? e4m3_to_f32(uint8_t(bias << mbits | mm)) : e5m2_to_f32(uint8_t(bias << mbits | mm));
      subnormal[m] = e4 ? e4m3_to_f32(uint8_t(mm)) : e5m2_to_f32(uint8_t(mm));
    }
  }
};
const Fp8Mantissas kE4M3Mantissas{true}, kE5M2Mantissas{false};

// The scales for which the bf16-out table decode (AVX2 and AVX-512) is exact: every result stays a normal
// bf16.
inline bool fp8_bf16_table_exact(bool e4, float s) {
  return s >= (e4 ? 0x1p-120f : 0x1p-112f) && s < (e4 ? 0x1p119f : 0x1p112f);
}
#endif

#if PPQ_ISA_AVX512
// ---- AVX-512 full-block paths ------------------------------------------------------------------
// Full blocks (every block but a partial last one) are a multiple of 16 values, so these loops run
// without remainders. They read fp32 or bf16 straight from the input (bf16 widened in-register: a zero
// extension and a shift), which is what makes the bf16 path as fast per value as the fp32 one; GCC's
// auto-vectorised form of the scalar loops spilled mask registers and ran at ~1 value per cycle.
// The math is the scalar code's, bit for bit (tests/quant/test_weight_kernels.py compares every code):
// cvtps_epi32 rounds to nearest even (the default MXCSR mode) like rne(); min/max take the constant
// first so that a NaN passes through as in the scalar clamps.
namespace avx {

using ppq::avx512::absmax_bits;
using ppq::avx512::block_max_lanes;
using ppq::avx512::fp8_rne16;
using ppq::avx512::fp8_value16;
using ppq::avx512::load16;

inline __m512 clamp(__m512 y, __m512 lo, __m512 hi) { return _mm512_min_ps(hi, _mm512_max_ps(lo, y)); }

// The maxima of 16 vectors at once, v[k] -> lane k: a transposing tree (45 shuffles and maxes for 16
// blocks instead of 16 separate horizontal reductions of ~10 instructions each).
inline __m512i max_transpose16(const __m512i* v) {
  __m512i w[8], z[4], p[2];
  for (int k = 0; k < 8; ++k)  // [v2k | v2k+1], 8 lanes each
    w[k] = _mm512_max_epu32(_mm512_shuffle_i64x2(v[2 * k], v[2 * k + 1], 0x44),
                            _mm512_shuffle_i64x2(v[2 * k], v[2 * k + 1], 0xee));
  for (int k = 0; k < 4; ++k)  // 4 lanes per block; 128-bit lane L holds block 4k + L
    z[k] = _mm512_max_epu32(_mm512_shuffle_i64x2(w[2 * k], w[2 * k + 1], 0x88),
                            _mm512_shuffle_i64x2(w[2 * k], w[2 * k + 1], 0xdd));
  for (int k = 0; k < 2; ++k)  // 2 lanes per block; lane L: blocks 8k + L, 8k + 4 + L
    p[k] = _mm512_max_epu32(_mm512_unpacklo_epi64(z[2 * k], z[2 * k + 1]),
                            _mm512_unpackhi_epi64(z[2 * k], z[2 * k + 1]));
  const __m512 p0 = _mm512_castsi512_ps(p[0]), p1 = _mm512_castsi512_ps(p[1]);
  const __m512i r = _mm512_max_epu32(_mm512_castps_si512(_mm512_shuffle_ps(p0, p1, 0x88)),
                                     _mm512_castps_si512(_mm512_shuffle_ps(p0, p1, 0xdd)));
  // lane 4L + k holds block 4k + L: transpose the 4 x 4
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// absmax_bits of 16 consecutive full blocks of B values into out[0..15].
template <typename T>
inline void absmax_bits16(const T* p, int64_t B, uint32_t* out) {
  __m512i v[16];
  for (int k = 0; k < 16; ++k) v[k] = block_max_lanes(p + k * B, B);
  __m512i r = max_transpose16(v);
  if constexpr (std::is_same_v<T, uint16_t>) r = _mm512_slli_epi32(r, 16);
  _mm512_storeu_si512(out, r);
}

// 16 codes in 0..15 (one per 32-bit lane) -> 8 bytes, (k[2i] << 4) + k[2i+1] in byte i. BIAS: the codes
// are k - BIAS / 17 (int4's signed codes, BIAS 0x88: both +8 in one add), so the byte is the low byte
// of (k[2i] << 4) + k[2i+1] + BIAS.
template <int BIAS = 0>
PPQ_ALWAYS_INLINE inline __m128i pack_nibbles(__m512i k) {
  __m512i pairs = _mm512_add_epi64(_mm512_slli_epi64(k, 4), _mm512_srli_epi64(k, 32));
  if constexpr (BIAS != 0) pairs = _mm512_add_epi64(pairs, _mm512_set1_epi64(BIAS));
  return _mm512_cvtepi64_epi8(pairs);  // low 8 bytes
}


// 16 NF4 codes (one per 32-bit lane) of y16 = 16 y.
inline __m512i nf4_codes(__m512 y16) {
  y16 = clamp(y16, _mm512_set1_ps(-16.0f), _mm512_set1_ps(16.0f));
  __m512i j = _mm512_cvt_roundps_epi32(y16, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  j = _mm512_min_epi32(_mm512_add_epi32(j, _mm512_set1_epi32(16)), _mm512_set1_epi32(31));  // y = 1: bin 31
  const __m512i base = _mm512_permutex2var_epi32(_mm512_loadu_si512(kBins.base), j,
                                                 _mm512_loadu_si512(kBins.base + 16));
  const __m512 mid = _mm512_permutex2var_ps(_mm512_loadu_ps(kBins.mid16), j, _mm512_loadu_ps(kBins.mid16 + 16));
  return _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(mid, y16, _CMP_LT_OQ), base, _mm512_set1_epi32(1));
}
// nf4_codes of y16 known to lie within +-16.5 (kHalfBins): no clamp, the bin by one add and a truncation.
PPQ_ALWAYS_INLINE inline __m512i nf4_codes_bounded(__m512 y16) {
  const __m512i j = _mm512_cvttps_epi32(_mm512_add_ps(y16, _mm512_set1_ps(15.5f)));
  const __m512i base = _mm512_permutex2var_epi32(_mm512_loadu_si512(kHalfBins.base), j,
                                                 _mm512_loadu_si512(kHalfBins.base + 16));
  const __m512 mid = _mm512_permutex2var_ps(_mm512_loadu_ps(kHalfBins.mid16), j, _mm512_loadu_ps(kHalfBins.mid16 + 16));
  return _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(mid, y16, _CMP_LT_OQ), base, _mm512_set1_epi32(1));
}

// fp8 codes of 16 values y = x / scale, clamped to +-Q: avx512.h's fp8_rne16 on the magnitude (the FPU
// does the rounding), then NaN (0x7f) and the sign bit, as fp8.h's f32_to_e4m3 / f32_to_e5m2.
template <bool E4M3>
inline __m512i fp8_codes(__m512 y) {  // one code per 32-bit lane
  const __m512 a = _mm512_min_ps(_mm512_set1_ps(E4M3 ? 448.0f : 57344.0f), _mm512_abs_ps(y));  // NaN stays
  __m512i r = fp8_rne16<E4M3>(a);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7f));  // NaN
  // r | (sign >> 24): ternary-logic A | (B & C)
  return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(_mm512_castps_si512(y), 24), _mm512_set1_epi32(0x80), 0xf8);
}

// fp8_codes for values known to be finite (y is never NaN): without the NaN select.
template <bool E4M3>
PPQ_ALWAYS_INLINE inline __m512i fp8_codes_finite(__m512 y) {
  const __m512i r = fp8_rne16<E4M3>(_mm512_min_ps(_mm512_set1_ps(E4M3 ? 448.0f : 57344.0f), _mm512_abs_ps(y)));
  return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(_mm512_castps_si512(y), 24), _mm512_set1_epi32(0x80), 0xf8);
}

// Values of 16 fp8 codes (low byte of each 32-bit lane): fp8.h's e4m3_to_f32 / e5m2_to_f32, i.e.
// avx512.h's fp8_value16 on the magnitude bits, then the NaN/Inf codes and the sign.
template <bool E4M3>
inline __m512 fp8_decode16(__m512i c) {
  const __m512i m7f = _mm512_set1_epi32(0x7f);
  const __m512i u = _mm512_and_si512(c, m7f);
  __m512i r = _mm512_castps_si512(fp8_value16<E4M3>(u));
  if constexpr (E4M3) {  // 0x7f: NaN
    r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(u, m7f), _mm512_set1_epi32(0x7fc00000));
  } else {  // 0x7c: Inf; above: NaN
    const __m512i special = _mm512_or_si512(
        _mm512_set1_epi32(0x7f800000),
        _mm512_maskz_mov_epi32(_mm512_cmpgt_epu32_mask(u, _mm512_set1_epi32(0x7c)), _mm512_set1_epi32(1 << 22)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32(0x7c)), special);
  }
  return _mm512_castsi512_ps(_mm512_or_si512(r, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24)));
}

// Store the codes of a full block, 32 values at a time: code16(i) gives the codes of values i..i+15,
// one per 32-bit lane; one byte permute packs two such vectors (vpmovdb costs two uops per 16 codes).
template <typename F>
inline void store_bytes(int64_t len, uint8_t* out, F code16) {
  const __m512i idx = _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                      0, 0, 0, 0, 0, 0, 124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80,
                                      76, 72, 68, 64, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
  int64_t i = 0;
#ifdef __AVX512VBMI__  // the avx512vbmi module (or PPQ_MARCH); x86-64-v4 has no byte permute
  for (; i + 32 <= len; i += 32) {
    const __m512i both = _mm512_permutex2var_epi8(code16(i), idx, code16(i + 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_castsi512_si256(both));
  }
#else
  (void)idx;
  for (; i + 16 < len; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(code16(i)));
#endif
  if (i < len) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(code16(i)));
}
// The same for 4-bit codes (0..15 per 32-bit lane), two per byte, the first in the high nibble.
template <typename F>
inline void store_nibbles(int64_t len, uint8_t* out, F code16) {
  const __m512i idx = _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                      120, 112, 104, 96, 88, 80, 72, 64, 56, 48, 40, 32, 24, 16, 8, 0);
  auto pairs = [](__m512i k) { return _mm512_or_si512(_mm512_slli_epi64(k, 4), _mm512_srli_epi64(k, 32)); };
  int64_t i = 0;
#ifdef __AVX512VBMI__
  for (; i + 32 <= len; i += 32) {
    const __m512i both = _mm512_permutex2var_epi8(pairs(code16(i)), idx, pairs(code16(i + 16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), _mm512_castsi512_si128(both));
  }
#else
  (void)idx;
  (void)pairs;
  for (; i + 16 < len; i += 16) _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), pack_nibbles(code16(i)));
#endif
  if (i < len) _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), pack_nibbles(code16(i)));
}

// Encode one full block (len a multiple of 16), given what its values are multiplied by: inv_scale(s),
// or for NF4 bitsandbytes' 1 / max(s, 1e-38). The codes are encode_block()'s.
template <typename T>
void encode_full_block(const T* x, int64_t len, Fmt f, float mult, uint8_t* codes) {
  const __m512 inv = _mm512_set1_ps(mult);
  switch (f) {
    case Fmt::I8: {
      const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
      store_bytes(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return _mm512_cvtps_epi32(clamp(_mm512_mul_ps(load16(x + i), inv), lo, hi)); });
      break;
    }
    case Fmt::I4: {
      const __m512 lo = _mm512_set1_ps(-7.0f), hi = _mm512_set1_ps(7.0f);
      const __m512i eight = _mm512_set1_epi32(8);
      store_nibbles(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE {
        return _mm512_add_epi32(_mm512_cvtps_epi32(clamp(_mm512_mul_ps(load16(x + i), inv), lo, hi)), eight);
      });
      break;
    }
    case Fmt::NF4: {
      if (mult <= 0x1p120f) {  // x * (16 / s) == 16 * (x / s)
        const __m512 inv16 = _mm512_set1_ps(16.0f * mult);
        store_nibbles(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return nf4_codes(_mm512_mul_ps(load16(x + i), inv16)); });
      } else {  // 16 / s would overflow (s < 1e-36): scale in two steps
        const __m512 sixteen = _mm512_set1_ps(16.0f);
        store_nibbles(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE {
          return nf4_codes(_mm512_mul_ps(_mm512_mul_ps(load16(x + i), inv), sixteen));
        });
      }
      break;
    }
    case Fmt::E4M3:
      store_bytes(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return fp8_codes<true>(_mm512_mul_ps(load16(x + i), inv)); });
      break;
    case Fmt::E5M2:
      store_bytes(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return fp8_codes<false>(_mm512_mul_ps(load16(x + i), inv)); });
      break;
  }
}

// bf16 out, 32 codes per vector in 16-bit lanes, no float arithmetic per value (the AVX2 path's
// method): bf16(value * s) depends on a normal code's exponent e only through a power of two, so a
// 16-word table per block, [bf16(value(e = bias, m) * s) for m = 0..7 | bf16(value(e = 0, m) * s)],
// looked up by one vpermw (subnormal codes at index m + 8), gives every result once a normal code's
// word has (e - bias) << 7 added to its exponent field. Exact while every result stays a normal bf16:
// s in [2^-120, 2^119) for e4m3, [2^-112, 2^112) for e5m2; false (nothing written) for other scales,
// which take the general decode. NaN codes give 0x7fc0, e5m2's Inf codes +-Inf. (The general decode,
// an fp32 multiply and a rounding per value, had held this at 0.44-0.49x a copy.)
template <bool E4M3>
bool fp8_bf16_words(const uint8_t* codes, int64_t len, float s, uint16_t* o) {
  if (!fp8_bf16_table_exact(E4M3, s)) return false;
  constexpr int mbits = E4M3 ? 3 : 2, bias = E4M3 ? 7 : 15;
  const Fp8Mantissas& t = E4M3 ? kE4M3Mantissas : kE5M2Mantissas;
  const __m512 vs = _mm512_set1_ps(s);
  const __m512 prod = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(t.normal)),
                                                       _mm256_load_ps(t.subnormal), 1), vs);
  const __m512i table = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits16(prod)));  // words 0..15; finite
  const __m512i mmask = _mm512_set1_epi16((1 << mbits) - 1), emask = _mm512_set1_epi16(E4M3 ? 15 : 31);
  const __m512i eight = _mm512_set1_epi16(8), vbias = _mm512_set1_epi16(bias), sbit = _mm512_set1_epi16(0x80);
  const __m512i bf16_nan = _mm512_set1_epi16(0x7fc0);
  auto words32 = [&](__m512i c) PPQ_ALWAYS_INLINE {  // 32 codes, one per 16-bit lane
    const __m512i m = _mm512_and_si512(c, mmask);
    const __m512i e = _mm512_and_si512(_mm512_srli_epi16(c, mbits), emask);
    const __mmask32 normal = _mm512_test_epi16_mask(e, e);
    __m512i v = _mm512_permutexvar_epi16(_mm512_mask_add_epi16(m, ~normal, m, eight), table);
    v = _mm512_mask_add_epi16(v, normal, v, _mm512_slli_epi16(_mm512_sub_epi16(e, vbias), 7));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, sbit), 8);
    v = _mm512_or_si512(v, sign);
    if constexpr (E4M3) {  // 0x7f / 0xff: NaN
      return _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(_mm512_andnot_si512(sbit, c), _mm512_set1_epi16(0x7f)), bf16_nan);
    } else {  // e = 31: Inf (m = 0, the code's sign) or NaN
      const __mmask32 special = _mm512_cmpeq_epi16_mask(e, emask);
      const __m512i inf = _mm512_or_si512(_mm512_set1_epi16(0x7f80), sign);
      return _mm512_mask_mov_epi16(v, special, _mm512_mask_mov_epi16(bf16_nan, _mm512_testn_epi16_mask(m, m), inf));
    }
  };
  int64_t i = 0;
  for (; i + 32 <= len; i += 32)
    _mm512_storeu_si512(o + i, words32(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)))));
  if (i < len) {  // 16 left
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm512_castsi512_si256(words32(c)));
  }
  return true;
}

// Decode one block of len (a multiple of 16) values: decode_block()'s values.
template <typename Out>
void decode_full_block(const uint8_t* codes, int64_t len, Fmt f, float s, Out* o) {
  const __m512 vs = _mm512_set1_ps(s);
  switch (f) {
    case Fmt::I8:
      for (int64_t i = 0; i < len; i += 16) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
        store16(o + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), vs));
      }
      break;
    case Fmt::I4:
    case Fmt::NF4: {
      alignas(64) float lut[16];
      for (int k = 0; k < 16; ++k) lut[k] = f == Fmt::NF4 ? kNF4[k] * s : float(k - 8) * s;
      const __m512 t = _mm512_load_ps(lut);
      for (int64_t i = 0; i < len; i += 16) {
        // 8 bytes -> one per 64-bit lane -> (c >> 4, c & 15) in its two 32-bit halves: codes in order.
        const __m512i c = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2)));
        const __m512i k = _mm512_or_si512(_mm512_srli_epi64(c, 4),
                                          _mm512_slli_epi64(_mm512_and_si512(c, _mm512_set1_epi64(15)), 32));
        store16(o + i, _mm512_permutexvar_ps(k, t));
      }
      break;
    }
    case Fmt::E4M3:
    case Fmt::E5M2:
      if constexpr (std::is_same_v<Out, uint16_t>) {
        if (f == Fmt::E4M3 ? fp8_bf16_words<true>(codes, len, s, o) : fp8_bf16_words<false>(codes, len, s, o)) break;
      }
      for (int64_t i = 0; i < len; i += 16) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
        store16(o + i, _mm512_mul_ps(f == Fmt::E4M3 ? fp8_decode16<true>(c) : fp8_decode16<false>(c), vs));
      }
      break;
  }
}

// Prefetch the 32 values at p (the next run's, as far ahead as this run is long): as the AVX2 path's
// prefetch_next, so that the memory works under a run's encode. Past the tensor's end it is a no-op.
PPQ_ALWAYS_INLINE inline void prefetch_next(const float* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + 16), _MM_HINT_T0);
}
PPQ_ALWAYS_INLINE inline void prefetch_next(const uint16_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// Encode a run of full blocks (len a multiple of 32, B = 1 << lgB >= 16), block b's values multiplied by
// mult[b]: encode_full_block()'s codes for each block in one loop, without a call, a switch and constant
// set-up per block (the AVX2 path's encode_run; at 64 values per block those cost as much as the codes).
// code16(y) gives 16 codes, one per 32-bit lane.
//
// bf16 input goes 32 values per load: the even-indexed values are the 32-bit lanes shifted left by 16,
// the odd-indexed ones the lanes with their low half cleared, so the codes of values 2i and 2i + 1 sit
// in lane i of two vectors. A nibble pair is then a shift and an add, 16 bytes one vpmovdb; two byte codes
// make a word (one vpmovdw per 32). Two widening loads and the 64-bit-lane nibble packing per 16 values
// had held the bf16 quantizers at 0.45-0.53x a copy (int4, FP8) and NF4 at 0.38.
//
// NIB_BIAS (nibbles only): as pack_nibbles' BIAS, the codes are signed and the pair's byte is the low byte
// of (a << 4) + b + NIB_BIAS.
template <typename T, bool NIBBLES, typename Code, int NIB_BIAS = 0>
PPQ_ALWAYS_INLINE inline void encode_run(const T* x, int64_t len, int lgB, const float* mult, uint8_t* out, Code code16) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u)), low_byte = _mm512_set1_epi32(0xff);
    for (int64_t i = 0; i < len; i += 32) {
      prefetch_next(x + i + kAhead);
      const __m512i w = _mm512_loadu_si512(x + i);
      // lanes 0-7 hold values 0-15, lanes 8-15 values 16-31 (another block when B = 16)
      const __m512 m = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(mult[i >> lgB]), _mm512_set1_ps(mult[(i + 16) >> lgB]));
      const __m512i a = code16(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), m));
      const __m512i b = code16(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), m));
      if constexpr (NIBBLES) {  // (a << 4) + b (+ NIB_BIAS): an or for codes in 0..15
        __m512i pair = _mm512_add_epi32(_mm512_slli_epi32(a, 4), b);
        if constexpr (NIB_BIAS != 0) pair = _mm512_add_epi32(pair, _mm512_set1_epi32(NIB_BIAS));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), _mm512_cvtepi32_epi8(pair));
      } else {  // (b << 8) | (a & 0xff): int8 codes are negative in 32 bits
        const __m512i pair = _mm512_ternarylogic_epi32(_mm512_slli_epi32(b, 8), a, low_byte, 0xf8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(pair));
      }
    }
  } else {
    for (int64_t i = 0; i < len; i += 32) {
      prefetch_next(x + i + kAhead);
      const __m512i a = code16(_mm512_mul_ps(load16(x + i), _mm512_set1_ps(mult[i >> lgB])));
      const __m512i b = code16(_mm512_mul_ps(load16(x + i + 16), _mm512_set1_ps(mult[(i + 16) >> lgB])));
      if constexpr (NIBBLES) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), pack_nibbles<NIB_BIAS>(a));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2 + 8), pack_nibbles<NIB_BIAS>(b));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(a));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 16), _mm512_cvtepi32_epi8(b));
      }
    }
  }
}

// The run's codes by format. For NF4, mult holds 16 / s (every block's <= 2^120: see encode_full_block).
// finite: no value of the run is NaN or Inf (the fp8 formats then skip the NaN select). bounded: finite,
// and every block's scale is normal or zero, so |x * mult| <= Q (1 + 2^-8) (a bf16 scale's rounding):
// int4 rounds into [-7, 7] and NF4's 16 y lie within +-16.5 without a clamp.
template <typename T>
void encode_full_run(const T* x, int64_t len, int lgB, Fmt f, const float* mult, bool finite, bool bounded,
                     uint8_t* codes) {
  if (bounded && f == Fmt::I4) {  // the +8 of both codes of a byte in one add of 0x88
    auto code16 = [](__m512 y) PPQ_ALWAYS_INLINE { return _mm512_cvtps_epi32(y); };
    return encode_run<T, true, decltype(code16), 0x88>(x, len, lgB, mult, codes, code16);
  }
  if (bounded && f == Fmt::NF4)
    return encode_run<T, true>(x, len, lgB, mult, codes, [](__m512 y) PPQ_ALWAYS_INLINE { return nf4_codes_bounded(y); });
  switch (f) {
    case Fmt::I8: {
      const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
      encode_run<T, false>(x, len, lgB, mult, codes, [&](__m512 y) PPQ_ALWAYS_INLINE { return _mm512_cvtps_epi32(clamp(y, lo, hi)); });
      break;
    }
    case Fmt::I4: {
      const __m512 lo = _mm512_set1_ps(-7.0f), hi = _mm512_set1_ps(7.0f);
      const __m512i eight = _mm512_set1_epi32(8);
      encode_run<T, true>(x, len, lgB, mult, codes, [&](__m512 y) PPQ_ALWAYS_INLINE {
        return _mm512_add_epi32(_mm512_cvtps_epi32(clamp(y, lo, hi)), eight);
      });
      break;
    }
    case Fmt::NF4:
      encode_run<T, true>(x, len, lgB, mult, codes, [](__m512 y) PPQ_ALWAYS_INLINE { return nf4_codes(y); });
      break;
    case Fmt::E4M3:
      if (finite) encode_run<T, false>(x, len, lgB, mult, codes, [](__m512 y) PPQ_ALWAYS_INLINE { return fp8_codes_finite<true>(y); });
      else encode_run<T, false>(x, len, lgB, mult, codes, [](__m512 y) PPQ_ALWAYS_INLINE { return fp8_codes<true>(y); });
      break;
    case Fmt::E5M2:
      if (finite) encode_run<T, false>(x, len, lgB, mult, codes, [](__m512 y) PPQ_ALWAYS_INLINE { return fp8_codes_finite<false>(y); });
      else encode_run<T, false>(x, len, lgB, mult, codes, [](__m512 y) PPQ_ALWAYS_INLINE { return fp8_codes<false>(y); });
      break;
  }
}

}  // namespace avx
#endif  // PPQ_ISA_AVX512

#if PPQ_ISA_AVX2
// ---- AVX2 full-block paths ---------------------------------------------------------------------
// The AVX-512 paths above on 8 lanes, with the same names and the same bits (tests compare every code
// and value with the reference on this path too). What differs: NF4 encodes by a binary search over
// its midpoints (the 32-bin table would take four vpermps and three blends per look-up); narrowing to
// bytes is avx2.h's bytes32/bytes16 (truncating, like vpmovdb); bf16 stores round in integer lanes and
// pack with vpackusdw; full chunks encode in one loop (encode_full_run, see the design note).
namespace avx {

using ppq::avx2::absmax_bits;
using ppq::avx2::block_max_lanes;
using ppq::avx2::bytes16;
using ppq::avx2::bytes32;
using ppq::avx2::fp8_codes;
using ppq::avx2::fp8_decode8;
using ppq::avx2::load8;
using ppq::avx2::store16;

PPQ_ALWAYS_INLINE inline __m256 clamp(__m256 y, __m256 lo, __m256 hi) { return _mm256_min_ps(hi, _mm256_max_ps(lo, y)); }

// Entry k & 15 of a 16-entry table held in t[0..1].
PPQ_ALWAYS_INLINE inline __m256 lookup16(const __m256* t, __m256i k) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[0], k), _mm256_permutevar8x32_ps(t[1], k),
                          _mm256_castsi256_ps(_mm256_slli_epi32(k, 28)));
}

// 16 fp32 -> bf16 (store16's bits) for values the caller knows are not NaN: rounded in 32-bit lanes,
// packed to words (the rounded values are <= 0xffff: no masking before vpackusdw), no NaN select.
PPQ_ALWAYS_INLINE inline void store16_bf16(uint16_t* o, __m256 a, __m256 b) {
  auto round = [](__m256 x) PPQ_ALWAYS_INLINE {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute4x64_epi64(_mm256_packus_epi32(round(a), round(b)), 0xd8));
}

// 8 NF4 codes (one per 32-bit lane) of y16 = 16 y: the number of midpoints m with 16 m < y16, by a
// four-step binary search over the 15 midpoints (the thresholds of the last two steps by vpermilps /
// vpermps from 4- and 8-entry tables). The AVX-512 path's 32 bins need 32-entry look-ups,
// four vpermps and three blends each on AVX2 (8 permutes per 8 values: the permute port held NF4 at
// ~0.2x copy). A NaN goes right at every step (code 15, as the reference's bucketize); values beyond
// +-16 need no clamp (every midpoint lies inside (-1, 1)).
struct NF4Tables {
  __m256 m7, m3, m11, t3, t4;  // 16 x midpoints 7, 3, 11; {1, 5, 9, 13} (in both 128-bit lanes); {0, 2, ..., 14}
  NF4Tables() {
    auto m16 = [](int i) { return kBins16[i]; };
    m7 = _mm256_set1_ps(m16(7)), m3 = _mm256_set1_ps(m16(3)), m11 = _mm256_set1_ps(m16(11));
    t3 = _mm256_setr_ps(m16(1), m16(5), m16(9), m16(13), m16(1), m16(5), m16(9), m16(13));
    t4 = _mm256_setr_ps(m16(0), m16(2), m16(4), m16(6), m16(8), m16(10), m16(12), m16(14));
  }
};
// The index grows by one bit per step (i = 2 i + (y16 > threshold); a true compare is -1, so i - gt):
// 13 operations, the third step's 4-entry look-up in-lane (vpermilps).
PPQ_ALWAYS_INLINE inline __m256i nf4_codes(const NF4Tables& t, __m256 y16) {
  const __m256i gt1 = _mm256_castps_si256(_mm256_cmp_ps(y16, t.m7, _CMP_NLE_UQ));  // y16 > m7, or NaN
  const __m256i gt2 = _mm256_castps_si256(
      _mm256_cmp_ps(y16, _mm256_blendv_ps(t.m3, t.m11, _mm256_castsi256_ps(gt1)), _CMP_NLE_UQ));
  const __m256i i3 = _mm256_sub_epi32(_mm256_and_si256(gt1, _mm256_set1_epi32(2)), gt2);  // 0..3
  const __m256i gt3 = _mm256_castps_si256(_mm256_cmp_ps(y16, _mm256_permutevar_ps(t.t3, i3), _CMP_NLE_UQ));
  const __m256i i4 = _mm256_sub_epi32(_mm256_add_epi32(i3, i3), gt3);  // 0..7
  const __m256i gt4 = _mm256_castps_si256(_mm256_cmp_ps(y16, _mm256_permutevar8x32_ps(t.t4, i4), _CMP_NLE_UQ));
  return _mm256_sub_epi32(_mm256_add_epi32(i4, i4), gt4);  // 0..15
}

// Store the codes of a full block (len a multiple of 16): code8(i) gives the codes of values i..i+7.
template <typename F>
PPQ_ALWAYS_INLINE inline void store_bytes(int64_t len, uint8_t* out, F code8) {
  int64_t i = 0;
  for (; i + 32 <= len; i += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bytes32(code8(i), code8(i + 8), code8(i + 16), code8(i + 24)));
  if (i < len) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bytes16(code8(i), code8(i + 8)));
}
// The same for 4-bit codes (0..15 in the low byte of each lane), two per byte, the first high.
template <typename F>
PPQ_ALWAYS_INLINE inline void store_nibbles(int64_t len, uint8_t* out, F code8) {
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    const __m256i w = bytes32(code8(i), code8(i + 8), code8(i + 16), code8(i + 24));  // 16-bit lane: c0 | c1 << 8
    const __m256i t = _mm256_and_si256(_mm256_or_si256(_mm256_slli_epi16(w, 4), _mm256_srli_epi16(w, 8)),
                                       _mm256_set1_epi16(0xff));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), _mm256_castsi256_si128(p));
  }
  if (i < len) {
    const __m128i w = bytes16(code8(i), code8(i + 8));
    const __m128i t = _mm_and_si128(_mm_or_si128(_mm_slli_epi16(w, 4), _mm_srli_epi16(w, 8)), _mm_set1_epi16(0xff));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), _mm_packus_epi16(t, t));
  }
}

// Encode one full block (len a multiple of 16): encode_block()'s codes.
template <typename T>
void encode_full_block(const T* x, int64_t len, Fmt f, float mult, uint8_t* codes) {
  const __m256 inv = _mm256_set1_ps(mult);
  switch (f) {
    case Fmt::I8: {
      const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
      store_bytes(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return _mm256_cvtps_epi32(clamp(_mm256_mul_ps(load8(x + i), inv), lo, hi)); });
      break;
    }
    case Fmt::I4: {
      const __m256 lo = _mm256_set1_ps(-7.0f), hi = _mm256_set1_ps(7.0f);
      const __m256i eight = _mm256_set1_epi32(8);
      store_nibbles(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE {
        return _mm256_add_epi32(_mm256_cvtps_epi32(clamp(_mm256_mul_ps(load8(x + i), inv), lo, hi)), eight);
      });
      break;
    }
    case Fmt::NF4: {
      const NF4Tables t;
      if (mult <= 0x1p120f) {  // x * (16 / s) == 16 * (x / s)
        const __m256 inv16 = _mm256_set1_ps(16.0f * mult);
        store_nibbles(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return nf4_codes(t, _mm256_mul_ps(load8(x + i), inv16)); });
      } else {
        const __m256 sixteen = _mm256_set1_ps(16.0f);
        store_nibbles(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE {
          return nf4_codes(t, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), inv), sixteen));
        });
      }
      break;
    }
    case Fmt::E4M3:
      store_bytes(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return fp8_codes<true>(_mm256_mul_ps(load8(x + i), inv)); });
      break;
    case Fmt::E5M2:
      store_bytes(len, codes, [&](int64_t i) PPQ_ALWAYS_INLINE { return fp8_codes<false>(_mm256_mul_ps(load8(x + i), inv)); });
      break;
  }
}

// absmax_bits of 8 consecutive full blocks of B values into out[0..7]: the lane maxima of each block, then
// one transposing tree (22 shuffles and maxes for 8 blocks instead of 8 horizontal reductions of ~7 each,
// each a serial chain).
template <typename T>
PPQ_ALWAYS_INLINE inline void absmax_bits8(const T* p, int64_t B, uint32_t* out) {
  __m256i v[8], w[4], z[2];
  for (int k = 0; k < 8; ++k) v[k] = block_max_lanes(p + k * B, B);
  for (int k = 0; k < 4; ++k)  // [v2k | v2k+1], 4 lanes each
    w[k] = _mm256_max_epu32(_mm256_permute2x128_si256(v[2 * k], v[2 * k + 1], 0x20),
                            _mm256_permute2x128_si256(v[2 * k], v[2 * k + 1], 0x31));
  for (int k = 0; k < 2; ++k)  // 128-bit lane L: 2 lanes each of blocks 4k + L, 4k + 2 + L
    z[k] = _mm256_max_epu32(_mm256_unpacklo_epi64(w[2 * k], w[2 * k + 1]), _mm256_unpackhi_epi64(w[2 * k], w[2 * k + 1]));
  const __m256 z0 = _mm256_castsi256_ps(z[0]), z1 = _mm256_castsi256_ps(z[1]);
  __m256i r = _mm256_max_epu32(_mm256_castps_si256(_mm256_shuffle_ps(z0, z1, 0x88)),
                               _mm256_castps_si256(_mm256_shuffle_ps(z0, z1, 0xdd)));
  // lanes: blocks 0 2 4 6 1 3 5 7
  r = _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (std::is_same_v<T, uint16_t>) r = _mm256_slli_epi32(r, 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), r);
}

// 32 values at x as four 8-lane vectors. fp32: in order. bf16: widened by interleaving with zeros
// (vpunpck{l,h}wd, no cross-lane widening), which leaves them as [0-3 8-11], [4-7 12-15], [16-19 24-27],
// [20-23 28-31]: pack32 below undoes either order with its last permute.
PPQ_ALWAYS_INLINE inline void load32(const float* x, __m256* v) {
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
}
PPQ_ALWAYS_INLINE inline void load32(const uint16_t* x, __m256* v) {
  const __m256i z = _mm256_setzero_si256();
  for (int k = 0; k < 2; ++k) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * k));
    v[2 * k] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
    v[2 * k + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
  }
}
// The low bytes of 32 code lanes (load32's order for T), in value order. MASK: clear the upper bytes
// first (codes that may lie outside 0..255: int codes of NaN, negative int8).
template <typename T, bool MASK>
PPQ_ALWAYS_INLINE inline __m256i pack32(const __m256i* c) {
  __m256i a = c[0], b = c[1], d = c[2], e = c[3];
  if constexpr (MASK) {
    const __m256i ff = _mm256_set1_epi32(0xff);
    a = _mm256_and_si256(a, ff), b = _mm256_and_si256(b, ff), d = _mm256_and_si256(d, ff), e = _mm256_and_si256(e, ff);
  }
  const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(d, e));
  if constexpr (std::is_same_v<T, float>)  // dwords [0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31]
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  else  // qwords [0-7 16-23 | 8-15 24-31]
    return _mm256_permute4x64_epi64(p, 0xd8);
}

// Prefetch the 32 values at p (the next run's, as far ahead as this run is long): the absmax pass is the
// only one that reads from memory, and without this the memory sat idle while a run was encoded (the
// encode's time added to the read's instead of hiding under it). Past the tensor's end it is a no-op.
PPQ_ALWAYS_INLINE inline void prefetch_next(const float* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + 16), _MM_HINT_T0);
}
PPQ_ALWAYS_INLINE inline void prefetch_next(const uint16_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// Encode a run of full blocks (len a multiple of 32, B = 1 << lgB), block b's values multiplied by
// mult[b]: the codes of encode_full_block() for each block, without a call, a switch and constant set-up
// per block (at 64 values per block those cost as much as the encoding). code(y) gives 8 codes.
template <typename T, bool NIBBLES, bool MASK, typename Code>
PPQ_ALWAYS_INLINE inline void encode_run(const T* x, int64_t len, int lgB, const float* mult, uint8_t* out, Code code) {
  for (int64_t i = 0; i < len; i += 32) {
    prefetch_next(x + i + kAhead);
    const __m256 m0 = _mm256_broadcast_ss(mult + (i >> lgB)), m1 = _mm256_broadcast_ss(mult + ((i + 16) >> lgB));
    __m256 v[4];
    load32(x + i, v);
    const __m256i c[4] = {code(_mm256_mul_ps(v[0], m0)), code(_mm256_mul_ps(v[1], m0)), code(_mm256_mul_ps(v[2], m1)),
                          code(_mm256_mul_ps(v[3], m1))};
    const __m256i w = pack32<T, MASK>(c);
    if constexpr (NIBBLES) {  // 16-bit lane: c0 | c1 << 8 -> (c0 << 4) | c1
      const __m256i t = _mm256_and_si256(_mm256_or_si256(_mm256_slli_epi16(w, 4), _mm256_srli_epi16(w, 8)),
                                         _mm256_set1_epi16(0xff));
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), _mm256_castsi256_si128(p));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), w);
    }
  }
}
// fp8 codes of a run whose values are all finite (so no y is NaN): the magnitude's code per lane, the sign
// bits packed alongside as bytes (signed saturation keeps the sign: 0x80 or 0x7f, masked to 0x80) and
// or-ed in before the last permute: fp8_codes()'s bytes without its NaN select and per-lane sign.
template <typename T, bool E4M3>
PPQ_ALWAYS_INLINE inline void encode_run_fp8_finite(const T* x, int64_t len, int lgB, const float* mult, uint8_t* out) {
  const __m256 q = _mm256_set1_ps(E4M3 ? 448.0f : 57344.0f);
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t i = 0; i < len; i += 32) {
    prefetch_next(x + i + kAhead);
    const __m256 m0 = _mm256_broadcast_ss(mult + (i >> lgB)), m1 = _mm256_broadcast_ss(mult + ((i + 16) >> lgB));
    __m256 v[4];
    load32(x + i, v);
    const __m256 y[4] = {_mm256_mul_ps(v[0], m0), _mm256_mul_ps(v[1], m0), _mm256_mul_ps(v[2], m1), _mm256_mul_ps(v[3], m1)};
    __m256i c[4];
    for (int k = 0; k < 4; ++k) c[k] = ppq::avx2::fp8_rne8<E4M3>(_mm256_min_ps(q, _mm256_and_ps(y[k], abs)));
    const __m256i mag = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    const __m256i sgn = _mm256_packs_epi16(_mm256_packs_epi32(_mm256_castps_si256(y[0]), _mm256_castps_si256(y[1])),
                                           _mm256_packs_epi32(_mm256_castps_si256(y[2]), _mm256_castps_si256(y[3])));
    __m256i w = _mm256_or_si256(mag, _mm256_and_si256(sgn, _mm256_set1_epi8(char(0x80))));
    if constexpr (std::is_same_v<T, float>)
      w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    else
      w = _mm256_permute4x64_epi64(w, 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), w);
  }
}

// The run's codes by format. For NF4, mult holds 16 / s (every block's <= 2^124: see encode_full_block).
// finite: no value of the run is NaN or Inf (the fp8 formats then skip the NaN select).
template <typename T>
void encode_full_run(const T* x, int64_t len, int lgB, Fmt f, const float* mult, bool finite,
                     [[maybe_unused]] bool bounded, uint8_t* codes) {
  if (finite && f == Fmt::E4M3) return encode_run_fp8_finite<T, true>(x, len, lgB, mult, codes);
  if (finite && f == Fmt::E5M2) return encode_run_fp8_finite<T, false>(x, len, lgB, mult, codes);
  switch (f) {
    case Fmt::I8: {
      const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
      encode_run<T, false, true>(x, len, lgB, mult, codes,
                                 [&](__m256 y) PPQ_ALWAYS_INLINE { return _mm256_cvtps_epi32(clamp(y, lo, hi)); });
      break;
    }
    case Fmt::I4: {
      const __m256 lo = _mm256_set1_ps(-7.0f), hi = _mm256_set1_ps(7.0f);
      const __m256i eight = _mm256_set1_epi32(8);
      encode_run<T, true, true>(x, len, lgB, mult, codes, [&](__m256 y) PPQ_ALWAYS_INLINE {
        return _mm256_add_epi32(_mm256_cvtps_epi32(clamp(y, lo, hi)), eight);
      });
      break;
    }
    case Fmt::NF4: {
      const NF4Tables t;
      encode_run<T, true, false>(x, len, lgB, mult, codes, [&](__m256 y) PPQ_ALWAYS_INLINE { return nf4_codes(t, y); });
      break;
    }
    case Fmt::E4M3:
      encode_run<T, false, false>(x, len, lgB, mult, codes, [](__m256 y) PPQ_ALWAYS_INLINE { return fp8_codes<true>(y); });
      break;
    case Fmt::E5M2:
      encode_run<T, false, false>(x, len, lgB, mult, codes, [](__m256 y) PPQ_ALWAYS_INLINE { return fp8_codes<false>(y); });
      break;
  }
}

// Decode one block of len (a multiple of 16) values: decode_block()'s values.
template <typename Out>
void decode_full_block(const uint8_t* codes, int64_t len, Fmt f, float s, Out* o) {
  const __m256 vs = _mm256_set1_ps(s);
  switch (f) {
    case Fmt::I8:
      if constexpr (std::is_same_v<Out, uint16_t>) {
        if (std::isfinite(s)) {  // code * s is then never NaN: no NaN select
          for (int64_t i = 0; i < len; i += 16) {
            const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
            store16_bf16(o + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), vs),
                         _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8))), vs));
          }
          break;
        }
      }
      for (int64_t i = 0; i < len; i += 16) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
        store16(o + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), vs),
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8))), vs));
      }
      break;
    case Fmt::I4:
    case Fmt::NF4: {
      // The 16 values (code level * s), built in two vector multiplies: built one by one (and rounded to
      // bf16 one by one) the tables cost more than decoding a 64-value block with them.
      static constexpr float kI4Levels[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
      const float* level = f == Fmt::NF4 ? kNF4 : kI4Levels;
      const __m256 l0 = _mm256_mul_ps(_mm256_loadu_ps(level), vs), l1 = _mm256_mul_ps(_mm256_loadu_ps(level + 8), vs);
      if constexpr (std::is_same_v<Out, uint16_t>) {
        // bf16 out: the 16 values as bf16 (store16's rounding) in two byte tables, then byte shuffles: 32
        // values per 16 code bytes, no conversion per value.
        const __m256i w = ppq::avx2::words16(ppq::avx2::bf16_bits8(l0), ppq::avx2::bf16_bits8(l1));
        const __m256i split = _mm256_permute4x64_epi64(  // [low bytes 0-15 | high bytes 0-15]
            _mm256_shuffle_epi8(w, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8,
                                                    10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)),
            0xd8);
        const __m128i vlo = _mm256_castsi256_si128(split), vhi = _mm256_extracti128_si256(split, 1);
        const __m128i m15 = _mm_set1_epi8(15);
        int64_t i = 0;
        for (; i + 32 <= len; i += 32) {
          const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i / 2));
          const __m128i first = _mm_and_si128(_mm_srli_epi16(x, 4), m15), second = _mm_and_si128(x, m15);
          const __m128i k0 = _mm_unpacklo_epi8(first, second), k1 = _mm_unpackhi_epi8(first, second);  // in order
          const __m128i l0 = _mm_shuffle_epi8(vlo, k0), h0 = _mm_shuffle_epi8(vhi, k0);
          const __m128i l1 = _mm_shuffle_epi8(vlo, k1), h1 = _mm_shuffle_epi8(vhi, k1);
          __m128i* op = reinterpret_cast<__m128i*>(o + i);
          _mm_storeu_si128(op, _mm_unpacklo_epi8(l0, h0));
          _mm_storeu_si128(op + 1, _mm_unpackhi_epi8(l0, h0));
          _mm_storeu_si128(op + 2, _mm_unpacklo_epi8(l1, h1));
          _mm_storeu_si128(op + 3, _mm_unpackhi_epi8(l1, h1));
        }
        if (i < len) {  // 16 left
          const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
          const __m128i k0 = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), m15), _mm_and_si128(x, m15));
          const __m128i l0 = _mm_shuffle_epi8(vlo, k0), h0 = _mm_shuffle_epi8(vhi, k0);
          __m128i* op = reinterpret_cast<__m128i*>(o + i);
          _mm_storeu_si128(op, _mm_unpacklo_epi8(l0, h0));
          _mm_storeu_si128(op + 1, _mm_unpackhi_epi8(l0, h0));
        }
        break;
      }
      const __m256 t[2] = {l0, l1};
      auto nibbles8 = [](const uint8_t* p) PPQ_ALWAYS_INLINE {  // 4 bytes -> their 8 codes in order, one per 32-bit lane
        int32_t w;
        std::memcpy(&w, p, 4);
        const __m256i c = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(w));
        return _mm256_or_si256(_mm256_srli_epi64(c, 4), _mm256_slli_epi64(_mm256_and_si256(c, _mm256_set1_epi64x(15)), 32));
      };
      for (int64_t i = 0; i < len; i += 16)
        store16(o + i, lookup16(t, nibbles8(codes + i / 2)), lookup16(t, nibbles8(codes + i / 2 + 4)));
      break;
    }
    case Fmt::E4M3:
    case Fmt::E5M2:
      if constexpr (std::is_same_v<Out, uint16_t>) {
        // bf16 out, 16 codes per 16-bit lane vector: the bf16 of code * s depends on the code's exponent
        // e only through a power of two, so per block two 8-word tables (one byte shuffle each) give
        // bf16(value(e = bias, m) * s) for every mantissa m and bf16(value(e = 0, m) * s) for the
        // subnormal codes, and a normal code's result is its table word plus (e - bias) << 7 (an
        // exponent add). Exact as long as every such result stays a normal bf16: s in [2^-120, 2^119)
        // (e4m3; e5m2 [2^-112, 2^112)); other scales take the general decode below. NaN codes: 0x7fc0.
        const bool e4 = f == Fmt::E4M3;
        if (fp8_bf16_table_exact(e4, s)) {
          const int mbits = e4 ? 3 : 2, bias = e4 ? 7 : 15;
          const Fp8Mantissas& t = e4 ? kE4M3Mantissas : kE5M2Mantissas;
          const __m256i w = ppq::avx2::words16(  // [normal table | subnormal table], 8 words each
              ppq::avx2::bf16_bits8(_mm256_mul_ps(_mm256_load_ps(t.normal), vs)),
              ppq::avx2::bf16_bits8(_mm256_mul_ps(_mm256_load_ps(t.subnormal), vs)));
          const __m256i tn = _mm256_permute2x128_si256(w, w, 0x00), tz = _mm256_permute2x128_si256(w, w, 0x11);
          const __m256i mmask = _mm256_set1_epi16(int16_t((1 << mbits) - 1)), emask = _mm256_set1_epi16(e4 ? 15 : 31);
          const __m256i vbias = _mm256_set1_epi16(int16_t(bias)), pairs = _mm256_set1_epi16(0x0202);
          const __m256i hi_byte = _mm256_set1_epi16(0x0100), sbit = _mm256_set1_epi16(0x80);
          const __m256i nan_code = _mm256_set1_epi16(0x7f), bf16_nan = _mm256_set1_epi16(0x7fc0);
          const __m256i zero = _mm256_setzero_si256(), emax = _mm256_set1_epi16(31);
          for (int64_t i = 0; i < len; i += 16) {
            const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
            const __m256i m = _mm256_and_si256(c, mmask);
            const __m256i idx = _mm256_add_epi16(_mm256_mullo_epi16(m, pairs), hi_byte);  // bytes 2m, 2m + 1
            const __m256i e = _mm256_and_si256(_mm256_srli_epi16(c, mbits), emask);
            const __m256i normal = _mm256_add_epi16(_mm256_shuffle_epi8(tn, idx),
                                                    _mm256_slli_epi16(_mm256_sub_epi16(e, vbias), 7));
            __m256i v = _mm256_blendv_epi8(normal, _mm256_shuffle_epi8(tz, idx), _mm256_cmpeq_epi16(e, zero));
            const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, sbit), 8);
            v = _mm256_xor_si256(v, sign);
            if (e4) {  // 0x7f / 0xff: NaN
              v = _mm256_blendv_epi8(v, bf16_nan, _mm256_cmpeq_epi16(_mm256_andnot_si256(sbit, c), nan_code));
            } else {  // e = 31: Inf (m = 0, the code's sign) or NaN
              const __m256i special = _mm256_cmpeq_epi16(e, emax);
              const __m256i inf = _mm256_or_si256(_mm256_set1_epi16(0x7f80), sign);
              v = _mm256_blendv_epi8(v, _mm256_blendv_epi8(bf16_nan, inf, _mm256_cmpeq_epi16(m, zero)), special);
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), v);
          }
          break;
        }
      }
      for (int64_t i = 0; i < len; i += 16) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
        const __m256i c0 = _mm256_cvtepu8_epi32(c), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
        if (f == Fmt::E4M3)
          store16(o + i, _mm256_mul_ps(fp8_decode8<true>(c0), vs), _mm256_mul_ps(fp8_decode8<true>(c1), vs));
        else
          store16(o + i, _mm256_mul_ps(fp8_decode8<false>(c0), vs), _mm256_mul_ps(fp8_decode8<false>(c1), vs));
      }
      break;
  }
}

}  // namespace avx
#endif  // PPQ_ISA_AVX2

// ---- checks -----------------------------------------------------------------------------------
int64_t nblocks(int64_t n, int64_t B) { return std::max<int64_t>(1, (n + B - 1) / B); }
int64_t ncodes(Fmt f, int64_t n) { return packed4(f) ? (n + 1) / 2 : n; }

void check_block(int64_t B) {
  TORCH_CHECK(B >= 16 && B <= 4096 && (B & (B - 1)) == 0, "block_size=", B,
              " is not allowed: use a power of two in [16, 4096]");
}
void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " has dtype ",
              t.scalar_type(), "; allowed: Float (fp32) or BFloat16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.numel() > 0, name, " is empty");
}
void check_codes(const at::Tensor& c, Fmt f, int64_t n) {
  TORCH_CHECK(c.scalar_type() == code_type(f), "codes has dtype ", c.scalar_type(), "; this format needs ",
              code_type(f));
  TORCH_CHECK(c.is_contiguous() && c.device().is_cpu(), "codes must be a contiguous CPU tensor");
  TORCH_CHECK(c.numel() == ncodes(f, n), "codes has ", c.numel(), " elements; ", n, " values need ",
              ncodes(f, n));
}
void check_scales(const at::Tensor& s, Fmt f, int64_t n, int64_t B, bool fp32_only) {
  TORCH_CHECK(s.scalar_type() == at::kFloat || (!fp32_only && s.scalar_type() == at::kBFloat16),
              "scales has dtype ", s.scalar_type(), "; allowed: Float", fp32_only ? "" : " or BFloat16");
  TORCH_CHECK(s.is_contiguous() && s.device().is_cpu(), "scales must be a contiguous CPU tensor");
  int64_t nb = nblocks(n, B);
  TORCH_CHECK(s.numel() == nb || (per_tensor_scale(f) && s.numel() == 1), "scales has ", s.numel(), " elements; ",
              n, " values in blocks of ", B, " need ", nb,
              per_tensor_scale(f) ? " (or 1 for a per-tensor fp8 scale)" : "");
}

// ---- ops --------------------------------------------------------------------------------------
template <bool BF16>
void quantize_impl(const at::Tensor& x, Fmt f, int64_t B, uint8_t* codes, const at::Tensor& scales,
                   bool given_scales) {
  using In = std::conditional_t<BF16, uint16_t, float>;
  const int64_t n = x.numel(), nb = nblocks(n, B);
  const In* xp = static_cast<const In*>(x.data_ptr());
  const bool per_tensor = scales.numel() == 1 && nb > 1;
  const bool bf16_scale = scales.scalar_type() == at::kBFloat16;
  float* sf = bf16_scale ? nullptr : scales.data_ptr<float>();
  uint16_t* sh = bf16_scale ? reinterpret_cast<uint16_t*>(scales.data_ptr()) : nullptr;
  const int64_t tail_len = n - (nb - 1) * B;
  auto block_len = [&](int64_t b) { return b == nb - 1 ? tail_len : B; };
  // Full blocks go straight from the input through the AVX-512 / AVX2 loops; the partial last block
  // (and every block in the scalar module) is widened to fp32 into `buf` and takes the scalar loops.
  auto block_absmax = [&](int64_t b, float* buf) {
    const int64_t len = block_len(b);
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
    if (len % 16 == 0) return avx::absmax_bits(xp + b * B, len);
#endif
    return absmax_bits(load_block<BF16>(xp, b * B, len, buf), len);
  };
  auto block_encode = [&](int64_t b, float s, float mult, float* buf) {
    const int64_t len = block_len(b);
    uint8_t* c = codes + (packed4(f) ? b * B / 2 : b * B);
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
    if (len == B) return avx::encode_full_block(xp + b * B, len, f, mult, c);
#endif
    encode_block(load_block<BF16>(xp, b * B, len, buf), len, f, s, len != B, c);
  };
  float tensor_scale = 0.0f;
  [[maybe_unused]] bool tensor_finite = false;
  if (per_tensor && !given_scales) {
    uint32_t m = 0;
#pragma omp parallel for num_threads(threads()) schedule(static) reduction(max : m)
    for (int64_t b = 0; b < nb; ++b) {
      alignas(64) float buf[4096];
      const uint32_t mb = block_absmax(b, buf);
      m = mb > m ? mb : m;
    }
    tensor_scale = make_scale(m, f, bf16_scale);
    tensor_finite = m < 0x7f800000u;
    if (bf16_scale) sh[0] = f32_to_bf16(tensor_scale); else sf[0] = tensor_scale;
  } else if (per_tensor) {
    tensor_scale = sf[0];
  }
  // Blocks go in chunks of >= 1024 values: the absmax of every block of a chunk, then all its scales
  // (one vectorised loop of divisions), then the encodes (the chunk is in L1 by then). This keeps
  // short blocks from paying a serial reduce -> divide -> divide latency chain each.
  const int64_t per_chunk = std::max<int64_t>(1, 1024 / B);
  const int64_t nchunks = (nb + per_chunk - 1) / per_chunk;
  const bool par = n > (1 << 15);  // small tensors stay on one thread
  [[maybe_unused]] const int lgB = std::countr_zero(uint64_t(B));
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(static)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    alignas(64) float buf[4096];
    alignas(64) float sc[64], mult[64];
    alignas(64) uint32_t mb[64];
    const int64_t b0 = ch * per_chunk, nbc = std::min(nb, b0 + per_chunk) - b0;
    if (per_tensor || given_scales) {
      for (int64_t j = 0; j < nbc; ++j) sc[j] = per_tensor ? tensor_scale : sf[b0 + j];
    } else {
      int64_t j = 0;
#if PPQ_ISA_AVX512
      if (B <= 64) {  // short blocks: 16 at a time, without a horizontal reduction each
        for (; j + 16 <= nbc && block_len(b0 + j + 15) == B; j += 16) avx::absmax_bits16(xp + (b0 + j) * B, B, mb + j);
      }
#elif PPQ_ISA_AVX2
      if (B <= 256) {  // 8 at a time, one transposing reduction
        for (; j + 8 <= nbc && block_len(b0 + j + 7) == B; j += 8) avx::absmax_bits8(xp + (b0 + j) * B, B, mb + j);
      }
#endif
      for (; j < nbc; ++j) mb[j] = block_absmax(b0 + j, buf);
      // make_scale() for the whole chunk, in loops without branches (they vectorise: a scalar division
      // per block cost as much as the absmax pass)
      const float q = qmax(f);
      for (int64_t j = 0; j < nbc; ++j) sc[j] = from_bits(mb[j]) / q;
      for (int64_t j = 0; j < nbc; ++j) sc[j] = mb[j] >= 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : sc[j];
      if (bf16_scale) {
        for (int64_t j = 0; j < nbc; ++j) sh[b0 + j] = f32_to_bf16(sc[j]);
        for (int64_t j = 0; j < nbc; ++j) sc[j] = bf16_to_f32(sh[b0 + j]);
      } else {
        for (int64_t j = 0; j < nbc; ++j) sf[b0 + j] = sc[j];
      }
    }
    if (f == Fmt::NF4) {  // two loops with the format test outside: both vectorise
      for (int64_t j = 0; j < nbc; ++j) mult[j] = 1.0f / std::max(sc[j], 1e-38f);
    } else {
      for (int64_t j = 0; j < nbc; ++j) mult[j] = inv_scale(sc[j]);
    }
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
    // A chunk of full blocks (all but the last chunk, or all when the last block is full) in one loop.
    const int64_t run = block_len(b0 + nbc - 1) == B ? nbc * B : 0;
    if (run > 0 && run % 32 == 0) {
      bool ok = true;
      alignas(64) float m16[64];
      if (f == Fmt::NF4) {  // 16 / s, as encode_full_block's fast case; a chunk with a block beyond it goes by block
        for (int64_t j = 0; j < nbc; ++j) ok &= mult[j] <= 0x1p120f;
        for (int64_t j = 0; j < nbc; ++j) m16[j] = 16.0f * mult[j];
      }
      // finite: the absmax bits were computed here and none is NaN/Inf (given scales say nothing of x)
      bool finite = !given_scales;
      if (finite && per_tensor) finite = tensor_finite;
      else if (finite) for (int64_t j = 0; j < nbc; ++j) finite &= mb[j] < 0x7f800000u;
      // bounded: finite and every scale normal or zero (encode_full_run)
      bool bounded = finite;
      for (int64_t j = 0; j < nbc; ++j) bounded &= sc[j] == 0.0f || sc[j] >= std::numeric_limits<float>::min();
      if (ok) {
        avx::encode_full_run(xp + b0 * B, run, lgB, f, f == Fmt::NF4 ? m16 : mult, finite, bounded,
                             codes + (packed4(f) ? b0 * B / 2 : b0 * B));
        continue;
      }
    }
#endif
    for (int64_t j = 0; j < nbc; ++j) block_encode(b0 + j, sc[j], mult[j], buf);
  }
}

void run_quantize(const at::Tensor& x, Fmt f, int64_t B, const at::Tensor& codes, const at::Tensor& scales,
                  bool given) {
  uint8_t* c = reinterpret_cast<uint8_t*>(codes.data_ptr());
  if (x.scalar_type() == at::kBFloat16) quantize_impl<true>(x, f, B, c, scales, given);
  else quantize_impl<false>(x, f, B, c, scales, given);
}

void weight_quantize_out(const at::Tensor& x, c10::string_view fmt, int64_t B, at::Tensor& codes,
                         at::Tensor& scales) {
  Fmt f = parse_fmt(fmt);
  check_block(B);
  check_float(x, "x");
  check_codes(codes, f, x.numel());
  check_scales(scales, f, x.numel(), B, false);
  run_quantize(x, f, B, codes, scales, false);
}

void weight_quantize_codes_out(const at::Tensor& x, const at::Tensor& scales, c10::string_view fmt, int64_t B,
                               at::Tensor& codes) {
  Fmt f = parse_fmt(fmt);
  check_block(B);
  check_float(x, "x");
  check_codes(codes, f, x.numel());
  check_scales(scales, f, x.numel(), B, true);
  run_quantize(x, f, B, codes, scales, true);
}

template <typename Out, typename S>
void dequantize_impl(const uint8_t* codes, const S* sp, bool per_tensor, Fmt f, int64_t B, int64_t n, Out* o) {
  const int64_t nb = nblocks(n, B), tail_len = n - (nb - 1) * B;
  auto scale = [&](int64_t b) {
    const S v = sp[per_tensor ? 0 : b];
    if constexpr (std::is_same_v<S, float>) return v; else return bf16_to_f32(v);
  };
  const bool par = n > (1 << 15);
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t len = b == nb - 1 ? tail_len : B;
    const uint8_t* c = codes + (packed4(f) ? b * B / 2 : b * B);
#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
    if (len % 16 == 0) {
      avx::decode_full_block<Out>(c, len, f, scale(b), o + b * B);
      continue;
    }
#endif
    decode_block<Out>(c, len, f, scale(b), o + b * B);
  }
}

void weight_dequantize_out(const at::Tensor& codes, const at::Tensor& scales, c10::string_view fmt, int64_t B,
                           at::Tensor& out) {
  Fmt f = parse_fmt(fmt);
  check_block(B);
  check_float(out, "out");
  const int64_t n = out.numel();
  check_codes(codes, f, n);
  check_scales(scales, f, n, B, false);
  const uint8_t* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const bool per_tensor = scales.numel() == 1;
  const bool sb = scales.scalar_type() == at::kBFloat16;
  const void* sp = scales.data_ptr();
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    if (sb) dequantize_impl(c, static_cast<const uint16_t*>(sp), per_tensor, f, B, n, o);
    else dequantize_impl(c, static_cast<const float*>(sp), per_tensor, f, B, n, o);
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
    if (sb) dequantize_impl(c, static_cast<const uint16_t*>(sp), per_tensor, f, B, n, o);
    else dequantize_impl(c, static_cast<const float*>(sp), per_tensor, f, B, n, o);
  }
}

std::tuple<at::Tensor, at::Tensor> weight_quantize(const at::Tensor& x, c10::string_view fmt, int64_t B,
                                                   at::ScalarType scale_dtype, bool per_tensor) {
  Fmt f = parse_fmt(fmt);
  check_block(B);
  TORCH_CHECK(scale_dtype == at::kFloat || scale_dtype == at::kBFloat16, "scale_dtype=", scale_dtype,
              " is not allowed: use Float or BFloat16");
  TORCH_CHECK(!per_tensor || per_tensor_scale(f), "per_tensor=True is only for fp8 formats, got fmt=",
              std::string(fmt));
  const int64_t n = x.numel();
  at::Tensor codes = at::empty({ncodes(f, n)}, x.options().dtype(code_type(f)));
  at::Tensor scales = at::empty({per_tensor ? 1 : nblocks(n, B)}, x.options().dtype(scale_dtype));
  weight_quantize_out(x, fmt, B, codes, scales);
  return {codes, scales};
}

at::Tensor weight_dequantize(const at::Tensor& codes, const at::Tensor& scales, c10::string_view fmt, int64_t B,
                             at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype=", dtype,
              " is not allowed: use Float or BFloat16");
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  weight_dequantize_out(codes, scales, fmt, B, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CPU, m) {
  m.impl("weight_quantize_out", &weight_quantize_out);
  m.impl("weight_quantize_codes_out", &weight_quantize_codes_out);
  m.impl("weight_dequantize_out", &weight_dequantize_out);
  m.impl("weight_quantize", &weight_quantize);
  m.impl("weight_dequantize", &weight_dequantize);
}
