// Stage-boundary codecs on CUDA: fused min-max quantize+pack and unpack+dequantize (any granularity).
//
// Design note. Plain CUDA C++ (raw pointers and a stream) so nvcc compiles it on CPU-only CI; the torch
// binding lives in codecs_binding.cpp. The arithmetic is the one documented in
// deepspeed_ppq/compress/ops.py (the CPU kernels and the reference follow it bit for bit):
//  * stats: one block per group; a block-wide min/max reduction (NaN flagged separately, since fminf
//    ignores NaN); range and 1/range in double as the spec says;
//  * codes: one thread per "pack unit" (1, 2 or 4 values = whole bytes), so no two threads write the same
//    byte and the packed stream needs no atomics; each thread finds its values' groups by division.
// FP8 and TopK run on the reference path on CUDA for now.
#include <cfloat>
#include <cstdint>
#include <cuda_runtime.h>

namespace ppq_cuda {

__device__ __forceinline__ float round_nonneg(float t) { return __fsub_rn(__fadd_rn(t, 12582912.0f), 12582912.0f); }

__global__ void minmax_stats_kernel(const float* __restrict__ x, int64_t d, int64_t group, int64_t ng,
                                    int levels, float* __restrict__ mins, float* __restrict__ scales,
                                    float* __restrict__ invs, float* __restrict__ pres, int* __restrict__ bad) {
  const int64_t g = blockIdx.x;
  const int64_t r = g / ng, c0 = (g % ng) * group;
  const int64_t n = (c0 + group < d ? c0 + group : d) - c0;
  const float* p = x + r * d + c0;
  float mn = INFINITY, mx = -INFINITY;
  int nan = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float v = p[i];
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
    nan |= v != v;
  }
  __shared__ float smn[32], smx[32];
  __shared__ int snan[32];
  for (int o = 16; o > 0; o >>= 1) {
    mn = fminf(mn, __shfl_down_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_down_sync(0xffffffffu, mx, o));
    nan |= __shfl_down_sync(0xffffffffu, nan, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    smn[warp] = mn;
    smx[warp] = mx;
    snan[warp] = nan;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x / 32); ++w) {
      mn = fminf(mn, smn[w]);
      mx = fmaxf(mx, smx[w]);
      nan |= snan[w];
    }
    if (nan) mn = mx = NAN;
    if (nan || isinf(mn) || isinf(mx)) atomicOr(bad, 1);
    double rng = (double)mx - (double)mn;
    float pre = rng > (double)FLT_MAX ? 0.5f : 1.0f;
    mins[g] = mn;
    scales[g] = (float)(rng / levels);
    invs[g] = rng > 0 ? (float)((double)levels / (rng * pre)) : 0.0f;
    pres[g] = pre;
  }
}

__global__ void quant_codes_kernel(const float* __restrict__ x, int64_t n, int64_t d, int64_t group, int64_t ng,
                                   int bits, const float* __restrict__ mins, const float* __restrict__ invs,
                                   const float* __restrict__ pres, uint8_t* __restrict__ codes) {
  const int unit = bits == 8 ? 1 : (bits == 4 ? 2 : 4);
  const int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t i0 = u * unit;
  if (i0 >= n) return;
  const float lv = (float)((1 << bits) - 1);
  uint32_t word = 0;
  int cnt = 0;
  for (int j = 0; j < unit; ++j) {
    const int64_t i = i0 + j;
    if (i >= n) break;
    const int64_t g = (i / d) * ng + (i % d) / group;
    const float p = pres[g];
    float t = __fmul_rn(__fsub_rn(__fmul_rn(x[i], p), __fmul_rn(mins[g], p)), invs[g]);
    t = t > 0.0f ? t : 0.0f;
    t = t < lv ? t : lv;
    word |= (uint32_t)round_nonneg(t) << (bits * j);
    ++cnt;
  }
  const int64_t byte0 = i0 * bits / 8;
  const int nbytes = (cnt * bits + 7) / 8;
  for (int b = 0; b < nbytes; ++b) codes[byte0 + b] = (uint8_t)((word >> (8 * b)) & 255u);
}

__global__ void quant_decode_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ mins,
                                    const float* __restrict__ scales, int64_t n, int64_t d, int64_t group,
                                    int64_t ng, int bits, float* __restrict__ out) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t bit = i * bits;
  uint32_t w = codes[bit / 8];
  if ((bit % 8) + bits > 8) w |= (uint32_t)codes[bit / 8 + 1] << 8;
  const uint32_t q = (w >> (bit % 8)) & ((1u << bits) - 1u);
  const int64_t g = (i / d) * ng + (i % d) / group;
  out[i] = __fmaf_rn((float)q, scales[g], mins[g]);
}

// Host entry points (fp32 input/output). Scratch: invs and pres, G floats each; bad: one device int.
cudaError_t quant_encode_f32(const float* x, int64_t R, int64_t d, int64_t group, int bits, float* mins,
                             float* scales, float* invs, float* pres, uint8_t* codes, int* bad,
                             cudaStream_t stream) {
  const int64_t ng = (d + group - 1) / group, G = R * ng, n = R * d;
  cudaError_t e = cudaMemsetAsync(bad, 0, sizeof(int), stream);
  if (e != cudaSuccess) return e;
  if (G == 0) return cudaSuccess;
  minmax_stats_kernel<<<(unsigned)G, 256, 0, stream>>>(x, d, group, ng, (1 << bits) - 1, mins, scales, invs, pres, bad);
  const int unit = bits == 8 ? 1 : (bits == 4 ? 2 : 4);
  const int64_t units = (n + unit - 1) / unit;
  quant_codes_kernel<<<(unsigned)((units + 255) / 256), 256, 0, stream>>>(x, n, d, group, ng, bits, mins, invs, pres,
                                                                         codes);
  return cudaGetLastError();
}

cudaError_t quant_decode_f32(const uint8_t* codes, const float* mins, const float* scales, int64_t R, int64_t d,
                             int64_t group, int bits, float* out, cudaStream_t stream) {
  const int64_t ng = (d + group - 1) / group, n = R * d;
  if (n == 0) return cudaSuccess;
  quant_decode_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(codes, mins, scales, n, d, group, ng, bits,
                                                                       out);
  return cudaGetLastError();
}

}  // namespace ppq_cuda
