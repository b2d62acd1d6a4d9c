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
//    nearbyint/torch.round);
//  * TopK per sample: one pass builds a 65536-bin histogram of the top 16 bits of |x| (as IEEE bits,
//    which order like the values), a second pass keeps every index at or above the threshold bin in
//    ascending order, then the exact K-th key is found among the few candidates of the threshold bin
//    with nth_element and the list is compacted; ties go to the lower index (a stable sort's order).
//  * FP8 encode: group amax as an integer max over |x|'s bits, then the branch-free fp32 -> fp8 recipe
//    shared with the weight kernels (fp8.h), so both loops vectorise; decode reads a 256-entry table.
// The exact arithmetic every implementation follows is documented in deepspeed_ppq/compress/ops.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "isa.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "fp8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

struct GroupStats {
  float mn, scale, inv, p, mnp;  // p: prescale (0.5 when the range overflows a float), mnp = mn * p
  bool bad;
};

template <typename T>
GroupStats minmax_stats(const T* x, int64_t n, int64_t levels) {
  float mn = INFINITY, mx = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
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
    int64_t i = s0;
    while (i < s1) {  // runs of one group
      int64_t r = i / d, c = i % d;
      int64_t g = r * ng + c / group;
      int64_t end = std::min(s1, r * d + std::min(d, (c / group + 1) * group));
      const float mnp = stats[g].mnp, inv = stats[g].inv, p = stats[g].p;
      uint8_t* b = buf + (i - s0);
      const T* xp = x + i;
      for (int64_t j = 0; j < end - i; ++j) {
        float t = (float(xp[j]) * p - mnp) * inv;
        t = t > 0.0f ? t : 0.0f;  // NaN -> 0
        t = t < lv ? t : lv;
        b[j] = uint8_t(int32_t(round_nonneg(t)));
      }
      i = end;
    }
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
      unpack(cp + s0 * bits / 8, s1 - s0, bits, buf);
      int64_t i = s0;
      while (i < s1) {
        int64_t r = i / d, c = i % d;
        int64_t g = r * ng + c / group;
        int64_t end = std::min(s1, r * d + std::min(d, (c / group + 1) * group));
        const float mn = mp[g], sc = sp[g];
        const uint8_t* b = buf + (i - s0);
        scalar_t* o = op + i;
        for (int64_t j = 0; j < end - i; ++j) o[j] = scalar_t(std::fma(float(b[j]), sc, mn));
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
      for (int64_t i = 0; i < n; ++i) m = std::max(m, fbits(float(p[i])) & 0x7fffffffu);
      const float amax = fp8::from_bits(m);
      bad |= m >= 0x7f800000u;
      double a = amax;
      sp[g] = a > 0 ? float(a / fmax) : 1.0f;
      const float inv = a > 0 ? float(double(fmax) / a) : 1.0f;
      // Locals only in the loops: a byte store may alias anything, so a value read through the lambda's
      // captures would be reloaded after every store and the loop would stay scalar.
      const float q = fmax;
      if (fmt == 0) {
        for (int64_t i = 0; i < n; ++i) o[i] = fp8::f32_to_e4m3(clamp_fp8(float(p[i]) * inv, q));
      } else {
        for (int64_t i = 0; i < n; ++i) o[i] = fp8::f32_to_e5m2(clamp_fp8(float(p[i]) * inv, q));
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
      for (int64_t i = 0; i < n; ++i) o[i] = scalar_t(lut[c[i]] * s);
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

template <typename T>
bool topk_row(const T* x, int64_t L, int64_t k, int64_t* idx, std::vector<uint32_t>& hist,
              std::vector<int64_t>& cand) {
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
  for (int64_t i = 0; i < L; ++i)
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
        bad |= topk_row(xp + b * L, L, k, ip + b * k, hist, cand);
        for (int64_t j = 0; j < k; ++j) vp[b * k + j] = xp[b * L + ip[b * k + j]];
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

void pack_bits(const at::Tensor& idx, int64_t bits, at::Tensor out) {
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous(), "idx must be contiguous int64");
  TORCH_CHECK(bits >= 1 && bits <= 56, "bits must be in [1, 56], got ", bits);
  const int64_t n = idx.numel();
  check_buffer(out, at::kByte, packed_nbytes(n, bits), "out");
  const int64_t* ip = idx.data_ptr<int64_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t blocks = (n + 7) / 8;  // 8 values = `bits` whole bytes
  const uint64_t mask = (uint64_t(1) << bits) - 1;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int64_t i0 = blk * 8, i1 = std::min(n, i0 + 8);
    uint8_t* dst = op + blk * bits;
    int64_t nbytes = packed_nbytes(i1 - i0, bits);
    uint64_t acc = 0;
    int nacc = 0;
    int64_t w = 0;
    for (int64_t i = i0; i < i1; ++i) {
      acc |= (uint64_t(ip[i]) & mask) << nacc;
      nacc += int(bits);
      while (nacc >= 8) {
        dst[w++] = acc & 255;
        acc >>= 8;
        nacc -= 8;
      }
    }
    if (w < nbytes) dst[w++] = acc & 255;
  }
}

void unpack_bits(const at::Tensor& packed, int64_t bits, at::Tensor out) {
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous(), "out must be contiguous int64");
  TORCH_CHECK(bits >= 1 && bits <= 56, "bits must be in [1, 56], got ", bits);
  const int64_t n = out.numel();
  check_buffer(packed, at::kByte, packed_nbytes(n, bits), "packed");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t blocks = (n + 7) / 8;
  const uint64_t mask = (uint64_t(1) << bits) - 1;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int64_t i0 = blk * 8, i1 = std::min(n, i0 + 8);
    const uint8_t* src = pp + blk * bits;
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
