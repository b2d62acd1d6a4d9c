// Stochastic-rounding blockwise quantization of weights to int8 / fp8 e4m3 / fp8 e5m2 on CUDA.
//
// Design note.
// * Same math as deepspeed_ppq/quant/sr_ops.py and csrc/cpu/weights_sr.cpp, bit for bit given the same
//   (seed, offset): scales as the deterministic quantizer (absmax / Q rounded to fp32 or bf16, or one
//   per-tensor scale), the counter-based "lowbias32" hash for element i's random bits (counter offset + i,
//   so no generator state and any thread order), and the exact round-up test u * (hi - lo) < a - lo on
//   the magnitude. Products and differences use the _rn intrinsics so nvcc cannot contract them into FMAs.
// * One thread block per quantization block (B <= 4096 values), 128 threads: absmax over the integer bits
//   of |x| (warp shuffles, then shared memory; bits >= 0x7f800000 mark NaN/Inf -> NaN scale, zero codes),
//   thread 0 writes the scale, all threads encode. A per-tensor fp8 scale takes the global max first.
// * Plain CUDA C++ (raw pointers and a stream, no torch headers) so nvcc compiles it on CPU-only CI;
//   csrc/cuda/weights_sr_binding.cpp validates tensors and calls the entry point.
// * bf16 helpers, loads, the block max and the stored scale come from common.cuh (shared with weights.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace ppq_cuda {

namespace {

using common::kThreads;
using common::bf16_to_f32;
using common::f32_to_bf16;
using common::load;
using common::block_max;
// The formats (those with formats::has_sr come here), their Q and fp8 top codes: common/formats.h.
using ppq::formats::Fmt;
// Round-to-nearest-even magnitude codes (input finite, >= 0, <= the format's max), as c10's conversion.
__device__ __forceinline__ int e4m3_code(uint32_t u) {
  if (u < (121u << 23)) {
    constexpr uint32_t dm = 141u << 23;
    return int(__float_as_uint(__fadd_rn(__uint_as_float(u), __uint_as_float(dm))) - dm);
  }
  return int((u + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((u >> 20) & 1u)) >> 20);
}
__device__ __forceinline__ int e5m2_code(uint32_t u) {
  if (u < (113u << 23)) {
    constexpr uint32_t dm = 134u << 23;
    return int(__float_as_uint(__fadd_rn(__uint_as_float(u), __uint_as_float(dm))) - dm);
  }
  return int((u + ((uint32_t)(15 - 127) << 23) + 0xfffffu + ((u >> 21) & 1u)) >> 21);
}
__device__ __forceinline__ float e4m3_mag(int u) {
  return u >= 8 ? __uint_as_float((uint32_t(u) << 20) + (120u << 23)) : __fmul_rn(float(u), 0x1p-9f);
}
__device__ __forceinline__ float e5m2_mag(int u) {
  return u >= 4 ? __uint_as_float((uint32_t(u) << 21) + (112u << 23)) : __fmul_rn(float(u), 0x1p-16f);
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {  // "lowbias32"
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
__device__ __forceinline__ float uniform24(uint64_t c, uint32_t key) {
  const uint32_t r = hash32(uint32_t(c) ^ hash32(key ^ uint32_t(c >> 32)));
  return __fmul_rn(float(r >> 8), 0x1p-24f);
}

__device__ __forceinline__ uint8_t sr_encode(float v, Fmt f, float inv, bool finite, float u) {
  const float q = ppq::formats::qmax(f);
  float y = finite ? __fmul_rn(v, inv) : 0.0f;
  y = y < -q ? -q : (y > q ? q : y);
  const float a = fabsf(y);
  if (f == Fmt::I8) {
    const float lo = floorf(a);
    const int k = int(lo) + (__fmul_rn(u, 1.0f) < __fsub_rn(a, lo) ? 1 : 0);
    return uint8_t(int8_t(y < 0.0f ? -k : k));
  }
  const bool e4 = f == Fmt::E4M3;
  const int top = ppq::formats::max_code(f);
  const uint32_t ua = __float_as_uint(a);
  const int c = e4 ? e4m3_code(ua) : e5m2_code(ua);
  const float vc = e4 ? e4m3_mag(c) : e5m2_mag(c);
  const int lo_c = vc > a ? c - 1 : c;
  const int hi_c = lo_c >= top ? lo_c : lo_c + 1;
  const float lo = e4 ? e4m3_mag(lo_c) : e5m2_mag(lo_c);
  const float hi = e4 ? e4m3_mag(hi_c) : e5m2_mag(hi_c);
  const int k = __fmul_rn(u, __fsub_rn(hi, lo)) < __fsub_rn(a, lo) ? hi_c : lo_c;
  return uint8_t(y < 0.0f ? (k | 0x80) : k);
}

__device__ __forceinline__ float stored_scale(uint32_t m, Fmt f, bool scale_bf16) {
  return common::stored_scale(m, ppq::formats::qmax(f), scale_bf16);
}

__global__ void sr_global_absmax_kernel(const void* x, bool bf16, int64_t n, uint32_t* out) {
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = max(m, __float_as_uint(load(x, bf16, i)) & 0x7fffffffu);
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(out, m);
}

__global__ void sr_quantize_kernel(const void* x, bool x_bf16, int64_t n, Fmt f, int64_t B, uint8_t* codes,
                                   void* scales, bool scale_bf16, bool per_tensor, const uint32_t* gmax,
                                   uint32_t key, uint64_t offset) {
  __shared__ float s_sh;
  const int64_t b = blockIdx.x, start = b * B;
  const int64_t len = min(B, n - start);
  if (!per_tensor) {
    uint32_t m = 0;
    for (int64_t i = threadIdx.x; i < len; i += kThreads)
      m = max(m, __float_as_uint(load(x, x_bf16, start + i)) & 0x7fffffffu);
    m = block_max(m);
    if (threadIdx.x == 0) s_sh = stored_scale(m, f, scale_bf16);
  } else if (threadIdx.x == 0) {
    s_sh = stored_scale(*gmax, f, scale_bf16);
  }
  __syncthreads();
  const float s = s_sh;
  if (threadIdx.x == 0 && (!per_tensor || b == 0)) {
    if (scale_bf16) static_cast<uint16_t*>(scales)[per_tensor ? 0 : b] = f32_to_bf16(s);
    else static_cast<float*>(scales)[per_tensor ? 0 : b] = s;
  }
  const bool finite = s == s;  // a NaN scale marks a block with NaN/Inf
  const float inv = s > 0.0f ? fminf(__fdiv_rn(1.0f, s), 3.402823466e38f) : 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const int64_t j = start + i;
    codes[j] = sr_encode(load(x, x_bf16, j), f, inv, finite, uniform24(offset + uint64_t(j), key));
  }
}

uint32_t host_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

}  // namespace

// x: n fp32/bf16 values; codes: n bytes; scales: ceil(n/B) (or 1 when per_tensor) fp32/bf16;
// gmax_scratch: one uint32 of device memory (per-tensor only). fmt: a format with formats::has_sr.
cudaError_t weight_quantize_sr(const void* x, bool x_bf16, int64_t n, Fmt fmt, int64_t B, uint8_t* codes,
                               void* scales, bool scale_bf16, bool per_tensor, uint32_t seed, uint64_t offset,
                               uint32_t* gmax_scratch, cudaStream_t stream) {
  const int64_t nb = (n + B - 1) / B;
  if (per_tensor) {
    cudaError_t e = cudaMemsetAsync(gmax_scratch, 0, sizeof(uint32_t), stream);
    if (e != cudaSuccess) return e;
    const int64_t grid = nb < 1024 ? nb : 1024;
    sr_global_absmax_kernel<<<unsigned(grid), kThreads, 0, stream>>>(x, x_bf16, n, gmax_scratch);
  }
  sr_quantize_kernel<<<unsigned(nb), kThreads, 0, stream>>>(x, x_bf16, n, fmt, B, codes, scales, scale_bf16,
                                                            per_tensor, gmax_scratch, host_hash32(seed), offset);
  return cudaGetLastError();
}

}  // namespace ppq_cuda
