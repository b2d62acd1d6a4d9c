// Device helpers shared by the CUDA kernels (codecs.cu, topk.cu, bitpack.cu, adam8bit.cu, weights.cu,
// weights_sr.cu): bf16/fp16 bit conversions as torch does them, the element types the codec kernels are
// templated on, fp32 <-> fp8 bit conversions, warp/block reductions, and host-side launch helpers.
// Plain CUDA C++ (no torch headers), like the kernels that include it.
//
// Conversions are bit-exact with the CPU side: bf16 and fp16 narrowing round to nearest even and give
// c10's NaN (bf16 0x7fc0, fp16 0x7e00 with the sign); the fp8 recipes are c10's (csrc/cpu/fp8.h), in
// device code. Products and quotients elsewhere use the _rn intrinsics so nvcc cannot contract them into
// FMAs (which would change rounding and break equality with the CPU kernels).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace ppq_cuda {
namespace common {

constexpr int kThreads = 128;  // threads per quantization block (weights.cu, weights_sr.cu)

__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN -> 0x7fc0
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float f16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t f32_to_f16(float f) {  // round to nearest even, NaN -> 0x7e00 | sign
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(0x7e00u | ((u >> 16) & 0x8000u));
  return __half_as_ushort(__float2half_rn(f));
}
__device__ __forceinline__ float load(const void* x, bool bf16, int64_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

// Element types of the codec kernels: the storage type T, fp32 <-> T as torch converts, and the host code.
struct F32 {
  using T = float;
  static constexpr int kCode = kDtF32;
  __device__ static __forceinline__ float to_f32(T v) { return v; }
  __device__ static __forceinline__ T from_f32(float f) { return f; }
  __device__ static __forceinline__ uint32_t bits(T v) { return __float_as_uint(v); }
  __device__ static __forceinline__ T from_bits(uint32_t u) { return __uint_as_float(u); }
};
struct BF16 {
  using T = uint16_t;
  static constexpr int kCode = kDtBF16;
  __device__ static __forceinline__ float to_f32(T v) { return bf16_to_f32(v); }
  __device__ static __forceinline__ T from_f32(float f) { return f32_to_bf16(f); }
  __device__ static __forceinline__ uint32_t bits(T v) { return v; }
  __device__ static __forceinline__ T from_bits(uint32_t u) { return T(u); }
};
struct F16 {
  using T = uint16_t;
  static constexpr int kCode = kDtF16;
  __device__ static __forceinline__ float to_f32(T v) { return f16_to_f32(v); }
  __device__ static __forceinline__ T from_f32(float f) { return f32_to_f16(f); }
  __device__ static __forceinline__ uint32_t bits(T v) { return v; }
  __device__ static __forceinline__ T from_bits(uint32_t u) { return T(u); }
};

// Calls f(F32{}), f(BF16{}) or f(F16{}) for the dtype code; cudaErrorInvalidValue for another code.
template <typename Fn>
cudaError_t dispatch_float(int dt, Fn&& f) {
  switch (dt) {
    case kDtF32: return f(F32{});
    case kDtBF16: return f(BF16{});
    case kDtF16: return f(F16{});
    default: return cudaErrorInvalidValue;
  }
}

// ---- fp32 <-> fp8 bits (c10's round-to-nearest-even recipes; see csrc/cpu/fp8.h) ----------------------
// Encode inputs are clamped to the finite range or NaN; NaN becomes 0x7f with its sign, as in c10.
__device__ __forceinline__ uint8_t f32_to_e4m3(float f) {
  uint32_t u = __float_as_uint(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t r;
  if (u > 0x7f800000u) {
    r = 0x7f;
  } else if (u < (121u << 23)) {
    constexpr uint32_t dm = 141u << 23;
    r = __float_as_uint(__fadd_rn(__uint_as_float(u), __uint_as_float(dm))) - dm;
  } else {
    r = (u + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
    if (r == 0x7f) r = 0x7e;
  }
  return uint8_t(r | (sign >> 24));
}
__device__ __forceinline__ uint8_t f32_to_e5m2(float f) {
  uint32_t u = __float_as_uint(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t r;
  if (u > 0x7f800000u) {
    r = 0x7f;
  } else if (u < (113u << 23)) {
    constexpr uint32_t dm = 134u << 23;
    r = __float_as_uint(__fadd_rn(__uint_as_float(u), __uint_as_float(dm))) - dm;
  } else {
    r = (u + ((uint32_t)(15 - 127) << 23) + 0xfffffu + ((u >> 21) & 1u)) >> 21;
  }
  return uint8_t(r | (sign >> 24));
}
__device__ __forceinline__ float e4m3_to_f32(uint8_t c) {
  uint32_t u = c & 0x7fu;
  float mag = u >= 8u ? __uint_as_float((u << 20) + (120u << 23)) : __fmul_rn(float(u), 0x1p-9f);
  if (u == 0x7fu) mag = __uint_as_float(0x7fc00000u);
  return __uint_as_float(__float_as_uint(mag) | (uint32_t(c & 0x80u) << 24));
}
__device__ __forceinline__ float e5m2_to_f32(uint8_t c) {
  uint32_t u = c & 0x7fu;
  float mag = u >= 4u ? __uint_as_float((u << 21) + (112u << 23)) : __fmul_rn(float(u), 0x1p-16f);
  if (u >= 0x7cu) mag = __uint_as_float(u == 0x7cu ? 0x7f800000u : 0x7fc00000u);
  return __uint_as_float(__float_as_uint(mag) | (uint32_t(c & 0x80u) << 24));
}

// ---- reductions -------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t m) {
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Max over the block's threads of m (absmax bits); valid in thread 0. Blocks of kThreads threads.
__device__ __forceinline__ uint32_t block_max(uint32_t m) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  }
  return m;
}

// Max over a block of NT threads (a multiple of 32, <= 1024), returned to every thread. `red` is a
// caller's __shared__ array of NT / 32 words; the call syncs the block twice, so it may be reused after.
template <int NT>
__device__ __forceinline__ uint32_t block_max_all(uint32_t m, uint32_t* red) {
  m = warp_max_u32(m);
  __syncthreads();  // red may still be read by a previous call
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0;
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) m = max(m, red[w]);
  return m;
}

// absmax bits -> stored scale absmax / q, rounded to the scale dtype; NaN marks a non-finite block.
__device__ __forceinline__ float stored_scale(uint32_t m, float q, bool scale_bf16) {
  float s = m >= 0x7f800000u ? __uint_as_float(0x7fc00000u) : __fdiv_rn(__uint_as_float(m), q);
  return scale_bf16 ? bf16_to_f32(f32_to_bf16(s)) : s;
}

// ---- host helpers -----------------------------------------------------------------------------------
// Blocks for a grid-stride loop over `work` items of `per_block` each, at least 1, at most `cap`.
inline unsigned grid_blocks(int64_t work, int64_t per_block, int64_t cap = int64_t(1) << 20) {
  int64_t g = (work + per_block - 1) / per_block;
  return unsigned(g < 1 ? 1 : (g > cap ? cap : g));
}

}  // namespace common
}  // namespace ppq_cuda
