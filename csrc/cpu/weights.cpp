// Blockwise low-bit weight formats (int8, int4, nf4, fp8 e4m3/e5m2): quantize and dequantize on CPU.
//
// Design note.
// * The math is the one written in deepspeed_ppq/quant/ops.py, bit for bit: absmax per block over the
//   flattened tensor (last block may be partial), stored scale s = absmax / Q rounded to fp32/bf16,
//   codes computed against the stored scale. Tests compare codes with the reference exactly.
// * One pass over memory. A block (<= 4096 values, <= 16 KiB fp32) is read once from DRAM; the absmax
//   loop and the encode loop then run on L1-resident data. Blocks are independent, so OpenMP splits
//   them statically across torch's thread count (two cores here: one stream each).
// * Every inner loop is branch-free and written so GCC vectorises it with AVX-512 at -O3: absmax is a
//   max over the integer bits of |x| (finite, non-negative floats order like their bits, and
//   NaN/Inf show up as bits >= 0x7f800000, which marks the block's scale NaN: no extra pass for the
//   non-finite check); rounding is clamp-then-magic-add (exact round-to-nearest-even for |y| < 2^22);
//   fp8 encode is torch's own bit recipe (c10 fp8*_from_fp32_value) with selects instead of branches,
//   fp8 decode is arithmetic on the bits (torch's fp8->fp32 cast is a scalar loop); both are shared
//   with the other kernels in fp8.h. NF4 needs a table lookup: 15 compares against the midpoints to
//   encode, and a 16-entry AVX-512 permute to decode.
// * Outputs go into caller-provided buffers (`*_out` ops); the allocating ops allocate and call them.
// * bf16 in: widened per block into a stack buffer. bf16 out: round-to-nearest-even of the fp32 product,
//   as torch's .to(bfloat16).
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include "fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

enum class Fmt { I8, I4, NF4, E4M3, E5M2 };

constexpr float kNF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

struct Mid {
  float v[15];
  constexpr Mid() : v{} {
    for (int i = 0; i < 15; ++i) v[i] = (kNF4[i] + kNF4[i + 1]) / 2.0f;
  }
};
constexpr Mid kMid{};

Fmt parse_fmt(std::string_view f) {
  if (f == "int8") return Fmt::I8;
  if (f == "int4") return Fmt::I4;
  if (f == "nf4") return Fmt::NF4;
  if (f == "fp8_e4m3") return Fmt::E4M3;
  if (f == "fp8_e5m2") return Fmt::E5M2;
  TORCH_CHECK(false, "fmt='", std::string(f), "' is not a weight format: use int8, int4, nf4, fp8_e4m3 or fp8_e5m2");
}

float qmax(Fmt f) {
  switch (f) {
    case Fmt::I8: return 127.0f;
    case Fmt::I4: return 7.0f;
    case Fmt::NF4: return 1.0f;
    case Fmt::E4M3: return 448.0f;
    default: return 57344.0f;
  }
}

bool packed4(Fmt f) { return f == Fmt::I4 || f == Fmt::NF4; }
bool is_fp8(Fmt f) { return f == Fmt::E4M3 || f == Fmt::E5M2; }

at::ScalarType code_type(Fmt f) {
  switch (f) {
    case Fmt::I8: return at::kChar;
    case Fmt::I4:
    case Fmt::NF4: return at::kByte;
    case Fmt::E4M3: return at::kFloat8_e4m3fn;
    default: return at::kFloat8_e5m2;
  }
}

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

// ---- per-block pieces ---------------------------------------------------------------------
template <bool BF16>
inline const float* load_block(const void* x, int64_t start, int64_t len, float* buf) {
  if constexpr (BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(x) + start;
    for (int64_t i = 0; i < len; ++i) buf[i] = bf16_to_f32(p[i]);
    return buf;
  } else {
    return static_cast<const float*>(x) + start;
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
      int64_t i0 = 0;
#ifdef __AVX512F__
      // Branch-free binary search over the 15 sorted midpoints (padded with +inf to 16 lanes): four
      // permutes + compares per 16 values instead of 15 compares; same count of midpoints < y.
      const __m512 mids = _mm512_setr_ps(kMid.v[0], kMid.v[1], kMid.v[2], kMid.v[3], kMid.v[4], kMid.v[5],
                                         kMid.v[6], kMid.v[7], kMid.v[8], kMid.v[9], kMid.v[10], kMid.v[11],
                                         kMid.v[12], kMid.v[13], kMid.v[14], INFINITY);
      const __m512 lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f);
      const __m512 vr = _mm512_set1_ps(r), vsc = _mm512_set1_ps(sc);
      for (; i0 + 16 <= len; i0 += 16) {
        const __m512 x = _mm512_loadu_ps(v + i0);
        __m512 y = tail ? _mm512_div_ps(x, vsc) : _mm512_mul_ps(x, vr);
        y = _mm512_min_ps(_mm512_max_ps(y, lo), hi);
        __m512i k = _mm512_setzero_si512();
        for (int step = 8; step >= 1; step >>= 1) {
          const __m512 m = _mm512_permutexvar_ps(_mm512_add_epi32(k, _mm512_set1_epi32(step - 1)), mids);
          k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(m, y, _CMP_LT_OQ), k, _mm512_set1_epi32(step));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(nib + i0), _mm512_cvtepi32_epi8(k));
      }
#endif
      if (tail) {
        for (int64_t i = i0; i < len; ++i) nib[i] = code(v[i] / sc);
      } else {
        for (int64_t i = i0; i < len; ++i) nib[i] = code(v[i] * r);
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

#ifdef __AVX512F__
inline void store16(float* o, __m512 x) { _mm512_storeu_ps(o, x); }
inline void store16(uint16_t* o, __m512 x) {  // 16 x fp32 -> bf16, round to nearest even as f32_to_bf16
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
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
      int64_t i = 0;
#ifdef __AVX512F__
      {
        const __m512 t = _mm512_load_ps(lut);
        for (; i + 16 <= np; i += 16) {
          __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
          __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t);
          __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)), t);
          // interleave hi/lo: out[2j] = hi[j], out[2j+1] = lo[j]
          const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
          const __m512i i1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
          store16(o + 2 * i, _mm512_permutex2var_ps(hi, i0, lo));
          store16(o + 2 * i + 16, _mm512_permutex2var_ps(hi, i1, lo));
        }
      }
#endif
      for (; i < np; ++i) {
        uint8_t c = codes[i];
        store(o, 2 * i, lut[c >> 4]);
        store(o, 2 * i + 1, lut[c & 15]);
      }
      if (len & 1) store(o, len - 1, lut[codes[np] >> 4]);
      break;
    }
  }
}

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
  TORCH_CHECK(s.numel() == nb || (is_fp8(f) && s.numel() == 1), "scales has ", s.numel(), " elements; ", n,
              " values in blocks of ", B, " need ", nb, is_fp8(f) ? " (or 1 for a per-tensor fp8 scale)" : "");
}

// ---- ops --------------------------------------------------------------------------------------
template <bool BF16>
void quantize_impl(const at::Tensor& x, Fmt f, int64_t B, uint8_t* codes, const at::Tensor& scales,
                   bool given_scales) {
  const int64_t n = x.numel(), nb = nblocks(n, B);
  const void* xp = x.data_ptr();
  const bool per_tensor = scales.numel() == 1 && nb > 1;
  const bool bf16_scale = scales.scalar_type() == at::kBFloat16;
  float* sf = bf16_scale ? nullptr : scales.data_ptr<float>();
  uint16_t* sh = bf16_scale ? reinterpret_cast<uint16_t*>(scales.data_ptr()) : nullptr;
  const int64_t tail_len = n - (nb - 1) * B;
  float tensor_scale = 0.0f;
  if (per_tensor && !given_scales) {
    uint32_t m = 0;
#pragma omp parallel for num_threads(threads()) schedule(static) reduction(max : m)
    for (int64_t b = 0; b < nb; ++b) {
      alignas(64) float buf[4096];
      const int64_t len = b == nb - 1 ? tail_len : B;
      uint32_t mb = absmax_bits(load_block<BF16>(xp, b * B, len, buf), len);
      m = mb > m ? mb : m;
    }
    tensor_scale = make_scale(m, f, bf16_scale);
    if (bf16_scale) sh[0] = f32_to_bf16(tensor_scale); else sf[0] = tensor_scale;
  } else if (per_tensor) {
    tensor_scale = sf[0];
  }
  // Blocks go in chunks of >= 1024 values: the absmax of every block of a chunk, then all its scales
  // (one vectorised loop of divisions), then the encodes. This keeps short blocks from paying a serial
  // reduce -> divide -> divide latency chain each.
  const int64_t per_chunk = std::max<int64_t>(1, 1024 / B);
  const int64_t nchunks = (nb + per_chunk - 1) / per_chunk;
  const bool par = n > (1 << 15);  // small tensors stay on one thread
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(static)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    alignas(64) float buf[4096];
    alignas(64) float sc[64];
    alignas(64) uint32_t mb[64];
    const int64_t b0 = ch * per_chunk, b1 = std::min(nb, b0 + per_chunk), nbc = b1 - b0;
    const int64_t clen = (b1 == nb ? n : b1 * B) - b0 * B;
    const float* v = load_block<BF16>(xp, b0 * B, clen, buf);
    if (per_tensor || given_scales) {
      for (int64_t j = 0; j < nbc; ++j) sc[j] = per_tensor ? tensor_scale : sf[b0 + j];
    } else {
      for (int64_t j = 0; j < nbc; ++j) mb[j] = absmax_bits(v + j * B, std::min(B, clen - j * B));
      for (int64_t j = 0; j < nbc; ++j) sc[j] = make_scale(mb[j], f, bf16_scale);
      if (bf16_scale) {
        for (int64_t j = 0; j < nbc; ++j) sh[b0 + j] = f32_to_bf16(sc[j]);
      } else {
        for (int64_t j = 0; j < nbc; ++j) sf[b0 + j] = sc[j];
      }
    }
    for (int64_t j = 0; j < nbc; ++j) {
      const int64_t b = b0 + j, len = b == nb - 1 ? tail_len : B;
      encode_block(v + j * B, len, f, sc[j], len != B, codes + (packed4(f) ? b * B / 2 : b * B));
    }
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
    decode_block<Out>(codes + (packed4(f) ? b * B / 2 : b * B), len, f, scale(b), o + b * B);
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
  TORCH_CHECK(!per_tensor || is_fp8(f), "per_tensor=True is only for fp8 formats, got fmt=", std::string(fmt));
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
