// Stage-boundary codecs on CUDA: k-bit min-max quantize+pack / unpack+dequantize and FP8 with group scales
// (ppq::quant_encode, quant_decode, fp8_encode, fp8_decode), fp32 / bf16 / fp16 in and out.
//
// Design note. The arithmetic is the one documented in deepspeed_ppq/compress/ops.py, which the CPU kernels
// (csrc/cpu/codecs.cpp) and the reference follow bit for bit; here with the _rn intrinsics so that nvcc
// cannot contract a product and a sum into an FMA, and doubles where the spec says double.
//  * Encode = one group per warp (groups of <= 256 values) or per 256-thread block (longer groups), a grid-
//    stride loop over groups. The group is read once: up to 16 values per thread stay in registers between
//    the statistics (a warp-shuffle / shared-memory reduction: min and max with NaN flagged apart, since
//    fminf ignores NaN; for FP8 the max of |x|'s bits, which orders like |x| and puts NaN/Inf on top) and
//    the codes; longer groups re-read the rest from L1/L2. All in one kernel: no second pass over x.
//  * k-bit codes: each thread owns whole "pack units" (1, 2 or 4 values = 1, 1 or 3 bytes of the stream),
//    so no two threads write one byte. That needs every group to start on a whole byte of the packed
//    stream (group * bits and d * bits multiples of 8, the per-token case); otherwise the statistics run
//    first (one block per group) and a second kernel writes the codes by pack unit of the whole stream.
//  * Decode: element-wise, a 2-D grid (rows x chunks of 1024 columns), so the group of an element is one
//    32-bit division of its column; the stores are coalesced.
//  * status (one byte) is cleared first and set to 1 by any group holding a NaN or an Inf.
//  * Plain CUDA C++ (raw pointers and a stream) so nvcc compiles it on CPU-only CI; codecs_binding.cpp
//    validates the tensors and calls the entry points declared in kernels.h.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace ppq_cuda {
namespace {

using common::BF16;
using common::F16;
using common::F32;

constexpr int kEncThreads = 256;
constexpr int kRegValues = 16;  // values per thread kept in registers between statistics and codes

__device__ __forceinline__ float round_nonneg(float t) { return __fsub_rn(__fadd_rn(t, 12582912.0f), 12582912.0f); }

// ---- reductions over a group's TPG threads (a warp, or the whole 256-thread block) ----------------------
template <int TPG>
__device__ __forceinline__ void group_minmax(float& mn, float& mx, int& nan) {
  for (int o = 16; o > 0; o >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    nan |= __shfl_xor_sync(0xffffffffu, nan, o);
  }
  if (TPG > 32) {
    __shared__ float smn[kEncThreads / 32], smx[kEncThreads / 32];
    __shared__ int snan[kEncThreads / 32];
    __syncthreads();  // the arrays may still be read from the previous group
    if ((threadIdx.x & 31) == 0) {
      smn[threadIdx.x >> 5] = mn;
      smx[threadIdx.x >> 5] = mx;
      snan[threadIdx.x >> 5] = nan;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kEncThreads / 32; ++w) {
      mn = fminf(mn, smn[w]);
      mx = fmaxf(mx, smx[w]);
      nan |= snan[w];
    }
  }
}

template <int TPG>
__device__ __forceinline__ uint32_t group_max_bits(uint32_t m) {
  m = common::warp_max_u32(m);
  if (TPG > 32) {
    __shared__ uint32_t red[kEncThreads / 32];
    m = common::block_max_all<kEncThreads>(m, red);
  }
  return m;
}

// ---- k-bit min-max ---------------------------------------------------------------------------------------
struct MinMax {  // a group's statistics, as compress/ops.py defines them
  float mn, scale, inv, pre;
};

__device__ __forceinline__ MinMax minmax_stats(float mn, float mx, int nan, int levels) {
  if (nan) mn = mx = __uint_as_float(0x7fc00000u);
  const double rng = __dsub_rn(double(mx), double(mn));
  MinMax s;
  s.mn = mn;
  s.pre = rng > double(FLT_MAX) ? 0.5f : 1.0f;
  s.scale = __double2float_rn(__ddiv_rn(rng, double(levels)));
  s.inv = rng > 0 ? __double2float_rn(__ddiv_rn(double(levels), __dmul_rn(rng, double(s.pre)))) : 0.0f;
  return s;
}

__device__ __forceinline__ uint32_t minmax_code(float v, float pre, float mnp, float inv, float lv) {
  float t = __fmul_rn(__fsub_rn(__fmul_rn(v, pre), mnp), inv);
  t = t > 0.0f ? t : 0.0f;  // NaN -> 0
  t = t < lv ? t : lv;
  return uint32_t(round_nonneg(t));
}

// cnt (<= 4) codes packed little-endian into ceil(cnt * bits / 8) bytes at dst.
__device__ __forceinline__ void store_unit(uint8_t* dst, uint32_t word, int cnt, int bits) {
  const int nbytes = (cnt * bits + 7) / 8;
  for (int b = 0; b < nbytes; ++b) dst[b] = uint8_t((word >> (8 * b)) & 255u);
}

// Fused encode: groups start on whole bytes. U values per pack unit (8 bits: 1, 4 bits: 2, 2/6 bits: 4).
template <class E, int TPG, int U>
__global__ void __launch_bounds__(kEncThreads)
    quant_encode_fused_kernel(const typename E::T* __restrict__ x, int64_t d, int64_t group, int64_t ng,
                              int64_t G, int bits, float* __restrict__ mins, float* __restrict__ scales,
                              uint8_t* __restrict__ codes, uint8_t* __restrict__ status) {
  constexpr int VU = kRegValues / U;  // pack units per thread in registers
  constexpr int GPB = kEncThreads / TPG;
  const int sub = threadIdx.x / TPG, lane = threadIdx.x % TPG;
  const int levels = (1 << bits) - 1;
  const int unit_bytes = U * bits / 8;
  for (int64_t g0 = int64_t(blockIdx.x) * GPB; g0 < G; g0 += int64_t(gridDim.x) * GPB) {
    const int64_t g = g0 + sub;
    const bool active = g < G;
    const int64_t r = active ? g / ng : 0, c0 = active ? (g - r * ng) * group : 0;
    const int64_t n = active ? (d - c0 < group ? d - c0 : group) : 0;
    const int64_t nu = (n + U - 1) / U;
    const typename E::T* p = x + r * d + c0;
    float v[VU][U];
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
#pragma unroll
    for (int j = 0; j < VU; ++j) {
      const int64_t u = lane + int64_t(j) * TPG;
#pragma unroll
      for (int q = 0; q < U; ++q) {
        const int64_t i = u * U + q;
        v[j][q] = i < n ? E::to_f32(p[i]) : 0.0f;
        if (i < n) {
          mn = fminf(mn, v[j][q]);
          mx = fmaxf(mx, v[j][q]);
          nan |= v[j][q] != v[j][q];
        }
      }
    }
    for (int64_t i = (lane + int64_t(VU) * TPG) * U; i < n; i += int64_t(TPG) * U) {
#pragma unroll
      for (int q = 0; q < U; ++q) {
        if (i + q < n) {
          const float w = E::to_f32(p[i + q]);
          mn = fminf(mn, w);
          mx = fmaxf(mx, w);
          nan |= w != w;
        }
      }
    }
    group_minmax<TPG>(mn, mx, nan);
    const MinMax s = minmax_stats(mn, mx, nan, levels);
    if (active && lane == 0) {
      mins[g] = s.mn;
      scales[g] = s.scale;
      if (nan || isinf(s.mn) || isinf(mx)) *status = 1;
    }
    const float mnp = __fmul_rn(s.mn, s.pre), lv = float(levels);
    uint8_t* out = codes + (r * d + c0) * bits / 8;  // a whole byte (fused path's condition)
#pragma unroll
    for (int j = 0; j < VU; ++j) {
      const int64_t u = lane + int64_t(j) * TPG;
      if (u < nu) {
        uint32_t word = 0;
        int cnt = 0;
#pragma unroll
        for (int q = 0; q < U; ++q) {
          if (u * U + q < n) {
            word |= minmax_code(v[j][q], s.pre, mnp, s.inv, lv) << (bits * q);
            ++cnt;
          }
        }
        store_unit(out + u * unit_bytes, word, cnt, bits);
      }
    }
    for (int64_t u = lane + int64_t(VU) * TPG; u < nu; u += TPG) {
      uint32_t word = 0;
      int cnt = 0;
#pragma unroll
      for (int q = 0; q < U; ++q) {
        if (u * U + q < n) {
          word |= minmax_code(E::to_f32(p[u * U + q]), s.pre, mnp, s.inv, lv) << (bits * q);
          ++cnt;
        }
      }
      store_unit(out + u * unit_bytes, word, cnt, bits);
    }
  }
}

// Unfused path (groups not on whole bytes), 1/2: the statistics, one 256-thread block per group.
template <class E>
__global__ void __launch_bounds__(kEncThreads)
    minmax_stats_kernel(const typename E::T* __restrict__ x, int64_t d, int64_t group, int64_t ng, int64_t G,
                        int levels, float* __restrict__ mins, float* __restrict__ scales, float* __restrict__ invs,
                        float* __restrict__ pres, uint8_t* __restrict__ status) {
  for (int64_t g = blockIdx.x; g < G; g += gridDim.x) {
    const int64_t r = g / ng, c0 = (g - r * ng) * group;
    const int64_t n = d - c0 < group ? d - c0 : group;
    const typename E::T* p = x + r * d + c0;
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
    for (int64_t i = threadIdx.x; i < n; i += kEncThreads) {
      const float w = E::to_f32(p[i]);
      mn = fminf(mn, w);
      mx = fmaxf(mx, w);
      nan |= w != w;
    }
    group_minmax<kEncThreads>(mn, mx, nan);
    if (threadIdx.x == 0) {
      const MinMax s = minmax_stats(mn, mx, nan, levels);
      if (nan || isinf(s.mn) || isinf(mx)) *status = 1;
      mins[g] = s.mn;
      scales[g] = s.scale;
      invs[g] = s.inv;
      pres[g] = s.pre;
    }
  }
}

// Unfused path, 2/2: one thread per pack unit of the whole stream; each value finds its group by division.
template <class E>
__global__ void quant_codes_kernel(const typename E::T* __restrict__ x, int64_t n, int64_t d, int64_t group,
                                   int64_t ng, int bits, const float* __restrict__ mins,
                                   const float* __restrict__ invs, const float* __restrict__ pres,
                                   uint8_t* __restrict__ codes) {
  const int unit = bits == 8 ? 1 : (bits == 4 ? 2 : 4);
  const float lv = float((1 << bits) - 1);
  const int64_t units = (n + unit - 1) / unit;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i0 = u * unit;
    uint32_t word = 0;
    int cnt = 0;
    for (int j = 0; j < unit && i0 + j < n; ++j) {
      const int64_t i = i0 + j, rr = i / d;
      const int64_t g = rr * ng + (i - rr * d) / group;
      const float p = pres[g];
      word |= minmax_code(E::to_f32(x[i]), p, __fmul_rn(mins[g], p), invs[g], lv) << (bits * j);
      ++cnt;
    }
    store_unit(codes + i0 * bits / 8, word, cnt, bits);
  }
}

// ---- decode (k-bit and FP8): 2-D grid, rows x chunks of kDecCols columns ---------------------------------
constexpr int kDecThreads = 256;
constexpr int kDecPerThread = 4;
constexpr int kDecCols = kDecThreads * kDecPerThread;

template <class E>
__global__ void __launch_bounds__(kDecThreads)
    quant_decode_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ mins,
                        const float* __restrict__ scales, int64_t R, int64_t d, int64_t group, int64_t ng,
                        int bits, typename E::T* __restrict__ out) {
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
#pragma unroll
    for (int j = 0; j < kDecPerThread; ++j) {
      const uint32_t c = uint32_t(blockIdx.x) * kDecCols + j * kDecThreads + threadIdx.x;
      if (c >= d) break;
      const int64_t i = r * d + c, bit = i * bits;
      uint32_t w = codes[bit >> 3];
      if ((bit & 7) + bits > 8) w |= uint32_t(codes[(bit >> 3) + 1]) << 8;
      const uint32_t q = (w >> (bit & 7)) & mask;
      const int64_t g = r * ng + c / uint32_t(group);
      out[i] = E::from_f32(__fmaf_rn(float(q), scales[g], mins[g]));
    }
  }
}

// ---- FP8 -------------------------------------------------------------------------------------------------
template <bool kE4M3>
__device__ __forceinline__ uint8_t fp8_code(float v, float inv) {
  constexpr float fmax = kE4M3 ? 448.0f : 57344.0f;
  float y = __fmul_rn(v, inv);
  y = y < -fmax ? -fmax : y;  // comparisons, not fminf/fmaxf: a NaN stays NaN (code 0x7f / 0xff)
  y = y > fmax ? fmax : y;
  return kE4M3 ? common::f32_to_e4m3(y) : common::f32_to_e5m2(y);
}

template <class E, int TPG, bool kE4M3>
__global__ void __launch_bounds__(kEncThreads)
    fp8_encode_kernel(const typename E::T* __restrict__ x, int64_t d, int64_t group, int64_t ng, int64_t G,
                      float* __restrict__ scales, uint8_t* __restrict__ codes, uint8_t* __restrict__ status) {
  constexpr int V = kRegValues;
  constexpr int GPB = kEncThreads / TPG;
  constexpr double fmax = kE4M3 ? 448.0 : 57344.0;
  const int sub = threadIdx.x / TPG, lane = threadIdx.x % TPG;
  for (int64_t g0 = int64_t(blockIdx.x) * GPB; g0 < G; g0 += int64_t(gridDim.x) * GPB) {
    const int64_t g = g0 + sub;
    const bool active = g < G;
    const int64_t r = active ? g / ng : 0, c0 = active ? (g - r * ng) * group : 0;
    const int64_t n = active ? (d - c0 < group ? d - c0 : group) : 0;
    const typename E::T* p = x + r * d + c0;
    float v[V];
    uint32_t m = 0;  // max of |x|'s bits: finite values order like their bits; NaN/Inf land on top
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t i = lane + int64_t(j) * TPG;
      v[j] = i < n ? E::to_f32(p[i]) : 0.0f;
      m = max(m, __float_as_uint(v[j]) & 0x7fffffffu);
    }
    for (int64_t i = lane + int64_t(V) * TPG; i < n; i += TPG) m = max(m, __float_as_uint(E::to_f32(p[i])) & 0x7fffffffu);
    m = group_max_bits<TPG>(m);
    const double a = double(__uint_as_float(m));  // NaN when the group holds one: scale 1, inv 1
    const float scale = a > 0 ? __double2float_rn(__ddiv_rn(a, fmax)) : 1.0f;
    const float inv = a > 0 ? __double2float_rn(__ddiv_rn(fmax, a)) : 1.0f;
    if (active && lane == 0) {
      scales[g] = scale;
      if (m >= 0x7f800000u) *status = 1;
    }
    uint8_t* out = codes + r * d + c0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t i = lane + int64_t(j) * TPG;
      if (i < n) out[i] = fp8_code<kE4M3>(v[j], inv);
    }
    for (int64_t i = lane + int64_t(V) * TPG; i < n; i += TPG) out[i] = fp8_code<kE4M3>(E::to_f32(p[i]), inv);
  }
}

template <class E, bool kE4M3>
__global__ void __launch_bounds__(kDecThreads)
    fp8_decode_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, int64_t R, int64_t d,
                      int64_t group, int64_t ng, typename E::T* __restrict__ out) {
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
#pragma unroll
    for (int j = 0; j < kDecPerThread; ++j) {
      const uint32_t c = uint32_t(blockIdx.x) * kDecCols + j * kDecThreads + threadIdx.x;
      if (c >= d) break;
      const int64_t i = r * d + c;
      const float v = kE4M3 ? common::e4m3_to_f32(codes[i]) : common::e5m2_to_f32(codes[i]);
      out[i] = E::from_f32(__fmul_rn(v, scales[r * ng + c / uint32_t(group)]));
    }
  }
}

dim3 decode_grid(int64_t R, int64_t d) {
  return dim3(unsigned((d + kDecCols - 1) / kDecCols), unsigned(R < 65535 ? R : 65535));
}

// Encode launch: a warp per group up to 256 values, a block per group beyond.
template <typename Launch>
cudaError_t launch_by_group(int64_t group, int64_t G, Launch&& launch) {
  if (group <= 256) return launch(std::integral_constant<int, 32>{}, common::grid_blocks(G, kEncThreads / 32));
  return launch(std::integral_constant<int, kEncThreads>{}, common::grid_blocks(G, 1));
}

}  // namespace

cudaError_t quant_encode(const void* x, int dt, int64_t R, int64_t d, int64_t group, int bits, float* mins,
                         float* scales, float* scratch, uint8_t* codes, uint8_t* status, cudaStream_t stream) {
  if (d > 0 && group > d) group = d;  // one group per row either way; keeps column / group in 32 bits
  const int64_t ng = (d + group - 1) / group, G = R * ng, n = R * d;
  cudaError_t e = cudaMemsetAsync(status, 0, 1, stream);
  if (e != cudaSuccess || G == 0) return e;
  const bool fused = (group * bits) % 8 == 0 && (d * bits) % 8 == 0;
  return common::dispatch_float(dt, [&](auto tag) {
    using E = decltype(tag);
    const auto* xp = static_cast<const typename E::T*>(x);
    if (fused) {
      return launch_by_group(group, G, [&](auto tpg, unsigned blocks) {
        constexpr int TPG = decltype(tpg)::value;
        if (bits == 8) {
          quant_encode_fused_kernel<E, TPG, 1><<<blocks, kEncThreads, 0, stream>>>(xp, d, group, ng, G, bits, mins,
                                                                                   scales, codes, status);
        } else if (bits == 4) {
          quant_encode_fused_kernel<E, TPG, 2><<<blocks, kEncThreads, 0, stream>>>(xp, d, group, ng, G, bits, mins,
                                                                                   scales, codes, status);
        } else {
          quant_encode_fused_kernel<E, TPG, 4><<<blocks, kEncThreads, 0, stream>>>(xp, d, group, ng, G, bits, mins,
                                                                                   scales, codes, status);
        }
        return cudaGetLastError();
      });
    }
    float* invs = scratch;
    float* pres = scratch + G;
    minmax_stats_kernel<E><<<common::grid_blocks(G, 1), kEncThreads, 0, stream>>>(xp, d, group, ng, G, (1 << bits) - 1,
                                                                                 mins, scales, invs, pres, status);
    const int unit = bits == 8 ? 1 : (bits == 4 ? 2 : 4);
    quant_codes_kernel<E><<<common::grid_blocks((n + unit - 1) / unit, 256), 256, 0, stream>>>(
        xp, n, d, group, ng, bits, mins, invs, pres, codes);
    return cudaGetLastError();
  });
}

cudaError_t quant_decode(const uint8_t* codes, const float* mins, const float* scales, int64_t R, int64_t d,
                         int64_t group, int bits, void* out, int dt, cudaStream_t stream) {
  if (d > 0 && group > d) group = d;  // one group per row either way; keeps column / group in 32 bits
  const int64_t ng = (d + group - 1) / group;
  if (R * d == 0) return cudaSuccess;
  return common::dispatch_float(dt, [&](auto tag) {
    using E = decltype(tag);
    quant_decode_kernel<E><<<decode_grid(R, d), kDecThreads, 0, stream>>>(codes, mins, scales, R, d, group, ng, bits,
                                                                         static_cast<typename E::T*>(out));
    return cudaGetLastError();
  });
}

cudaError_t fp8_encode(const void* x, int dt, int64_t R, int64_t d, int64_t group, int fmt, float* scales,
                       uint8_t* codes, uint8_t* status, cudaStream_t stream) {
  if (d > 0 && group > d) group = d;  // one group per row either way; keeps column / group in 32 bits
  const int64_t ng = (d + group - 1) / group, G = R * ng;
  cudaError_t e = cudaMemsetAsync(status, 0, 1, stream);
  if (e != cudaSuccess || G == 0) return e;
  return common::dispatch_float(dt, [&](auto tag) {
    using E = decltype(tag);
    const auto* xp = static_cast<const typename E::T*>(x);
    return launch_by_group(group, G, [&](auto tpg, unsigned blocks) {
      constexpr int TPG = decltype(tpg)::value;
      if (fmt == 0) {
        fp8_encode_kernel<E, TPG, true><<<blocks, kEncThreads, 0, stream>>>(xp, d, group, ng, G, scales, codes, status);
      } else {
        fp8_encode_kernel<E, TPG, false><<<blocks, kEncThreads, 0, stream>>>(xp, d, group, ng, G, scales, codes, status);
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t fp8_decode(const uint8_t* codes, const float* scales, int64_t R, int64_t d, int64_t group, int fmt,
                       void* out, int dt, cudaStream_t stream) {
  if (d > 0 && group > d) group = d;  // one group per row either way; keeps column / group in 32 bits
  const int64_t ng = (d + group - 1) / group;
  if (R * d == 0) return cudaSuccess;
  return common::dispatch_float(dt, [&](auto tag) {
    using E = decltype(tag);
    auto* op = static_cast<typename E::T*>(out);
    if (fmt == 0) {
      fp8_decode_kernel<E, true><<<decode_grid(R, d), kDecThreads, 0, stream>>>(codes, scales, R, d, group, ng, op);
    } else {
      fp8_decode_kernel<E, false><<<decode_grid(R, d), kDecThreads, 0, stream>>>(codes, scales, R, d, group, ng, op);
    }
    return cudaGetLastError();
  });
}

}  // namespace ppq_cuda
