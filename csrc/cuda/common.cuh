// Device helpers shared by the CUDA weight kernels (weights.cu, weights_sr.cu): bf16 bit conversions,
// fp32/bf16 loads, the 128-thread block max over absmax bits, and the stored block scale.
// Plain CUDA C++ (no torch headers), like the kernels that include it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ppq_cuda {
namespace common {

constexpr int kThreads = 128;  // threads per quantization block

__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN -> 0x7fc0
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float load(const void* x, bool bf16, int64_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

// Max over the block's threads of m (absmax bits); valid in thread 0.
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

// absmax bits -> stored scale absmax / q, rounded to the scale dtype; NaN marks a non-finite block.
__device__ __forceinline__ float stored_scale(uint32_t m, float q, bool scale_bf16) {
  float s = m >= 0x7f800000u ? __uint_as_float(0x7fc00000u) : __fdiv_rn(__uint_as_float(m), q);
  return scale_bf16 ? bf16_to_f32(f32_to_bf16(s)) : s;
}

}  // namespace common
}  // namespace ppq_cuda
