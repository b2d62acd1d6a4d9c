// Blockwise low-bit weight formats (int8, int4, nf4, fp8 e4m3/e5m2) on CUDA: quantize and dequantize.
//
// Design note.
// * Same math as deepspeed_ppq/quant/ops.py and csrc/cpu/weights.cpp, bit for bit: absmax per block of the
//   flattened tensor (partial last block allowed), stored scale s = absmax / Q rounded to fp32/bf16, codes
//   against the stored scale. Products and quotients use the _rn intrinsics so nvcc cannot contract them
//   into FMAs (which would change rounding and break equality with the CPU codes).
// * Quantize: one thread block per quantization block (B <= 4096 values), 128 threads striding over it.
//   The absmax is a max over the integer bits of |x| (warp shuffles, then shared memory), which also
//   flags NaN/Inf (bits >= 0x7f800000 -> NaN scale, checked by the Python front end). Thread 0 writes the
//   scale; all threads then encode. 4-bit formats: each thread encodes a pair and writes one byte (first
//   value in the high nibble). Per-tensor fp8 scale: a first kernel takes the global max with atomicMax.
// * Dequantize: element-wise grid-stride loop (one byte of codes per thread step), coalesced loads and
//   stores; the block index is i / B. Outputs fp32 or bf16 (round to nearest even, as torch).
// * Plain CUDA C++ (raw pointers and a stream, no torch headers) so nvcc compiles it on CPU-only CI;
//   csrc/cuda/weights_binding.cpp validates tensors and calls these entry points.
// * bf16 helpers, loads, the block max, the stored scale and the fp8 bit conversions (the CPU file's
//   csrc/cpu/fp8.h in device code) come from common.cuh, shared with the other CUDA kernels.
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace ppq_cuda {

// The formats, their Q, packing and the NF4 codebook: common/formats.h (from deepspeed_ppq/formats.py).
using ppq::formats::Fmt;

namespace {

__constant__ float kNF4Code[16] = {PPQ_CODE_MAP_NF4};

using common::kThreads;
using common::bf16_to_f32;
using common::f32_to_bf16;
using common::load;
using common::block_max;
using common::e4m3_to_f32;
using common::e5m2_to_f32;
using common::f32_to_e4m3;
using common::f32_to_e5m2;

__device__ __forceinline__ float clampf(float y, float q) { return y < -q ? -q : (y > q ? q : y); }

// One value -> its code (int8 / fp8 byte, or a nibble for 4-bit formats).
__device__ __forceinline__ uint8_t encode(float v, Fmt f, float inv, float sc, bool tail) {
  switch (f) {
    case Fmt::I8: return uint8_t(int8_t(__float2int_rn(clampf(__fmul_rn(v, inv), 127.0f))));
    case Fmt::I4: return uint8_t(__float2int_rn(clampf(__fmul_rn(v, inv), 7.0f)) + 8);
    case Fmt::NF4: {  // bitsandbytes' rule: multiply by 1/max(s,1e-38), divide in a partial last block
      float y = clampf(tail ? __fdiv_rn(v, sc) : __fmul_rn(v, inv), 1.0f);
      int k = 0;
#pragma unroll
      for (int j = 0; j < 15; ++j) k += __fdiv_rn(__fadd_rn(kNF4Code[j], kNF4Code[j + 1]), 2.0f) < y;
      return uint8_t(k);
    }
    case Fmt::E4M3: return f32_to_e4m3(clampf(__fmul_rn(v, inv), 448.0f));
    default: return f32_to_e5m2(clampf(__fmul_rn(v, inv), 57344.0f));
  }
}

__device__ __forceinline__ float stored_scale(uint32_t m, Fmt f, bool scale_bf16) {
  return common::stored_scale(m, ppq::formats::qmax(f), scale_bf16);
}

__global__ void global_absmax_kernel(const void* x, bool bf16, int64_t n, uint32_t* out) {
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = max(m, __float_as_uint(load(x, bf16, i)) & 0x7fffffffu);
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(out, m);
}

// mode 0: per-block scales computed here; 1: per-tensor, computed (max in *gmax);
// 2: given fp32 per-block scales; 3: given fp32 per-tensor scale.
__global__ void quantize_kernel(const void* x, bool x_bf16, int64_t n, Fmt f, int64_t B, uint8_t* codes,
                                void* scales, bool scale_bf16, int mode, const uint32_t* gmax) {
  __shared__ float s_sh;
  const int64_t b = blockIdx.x, start = b * B;
  const int64_t len = min(B, n - start);
  if (mode == 0) {
    uint32_t m = 0;
    for (int64_t i = threadIdx.x; i < len; i += kThreads)
      m = max(m, __float_as_uint(load(x, x_bf16, start + i)) & 0x7fffffffu);
    m = block_max(m);
    if (threadIdx.x == 0) s_sh = stored_scale(m, f, scale_bf16);
  } else if (threadIdx.x == 0) {
    const float* given = static_cast<const float*>(scales);
    s_sh = mode == 1 ? stored_scale(*gmax, f, scale_bf16) : given[mode == 2 ? b : 0];
  }
  __syncthreads();
  const float s = s_sh;
  if (threadIdx.x == 0 && (mode == 0 || (mode == 1 && b == 0))) {
    if (scale_bf16) static_cast<uint16_t*>(scales)[mode == 1 ? 0 : b] = f32_to_bf16(s);
    else static_cast<float*>(scales)[mode == 1 ? 0 : b] = s;
  }
  float inv = s > 0.0f ? fminf(__fdiv_rn(1.0f, s), 3.402823466e38f) : 0.0f;
  const float sc = fmaxf(s, 1e-38f);
  const bool tail = len != B;
  if (f == Fmt::NF4) inv = __fdiv_rn(1.0f, sc);
  if (ppq::formats::packed4(f)) {
    const uint8_t pad = f == Fmt::NF4 ? 7 : 8;
    for (int64_t j = threadIdx.x; 2 * j < len; j += kThreads) {
      uint8_t hi = encode(load(x, x_bf16, start + 2 * j), f, inv, sc, tail);
      uint8_t lo = 2 * j + 1 < len ? encode(load(x, x_bf16, start + 2 * j + 1), f, inv, sc, tail) : pad;
      codes[start / 2 + j] = uint8_t((hi << 4) | lo);
    }
  } else {
    for (int64_t i = threadIdx.x; i < len; i += kThreads)
      codes[start + i] = encode(load(x, x_bf16, start + i), f, inv, sc, tail);
  }
}

__device__ __forceinline__ float value(uint8_t c, Fmt f) {
  return f == Fmt::I8 ? float(int8_t(c)) : f == Fmt::E4M3 ? e4m3_to_f32(c) : e5m2_to_f32(c);
}
__device__ __forceinline__ void store(void* o, bool bf16, int64_t i, float v) {
  if (bf16) static_cast<uint16_t*>(o)[i] = f32_to_bf16(v);
  else static_cast<float*>(o)[i] = v;
}

__global__ void dequantize_kernel(const uint8_t* codes, const void* scales, bool scale_bf16, bool per_tensor,
                                  Fmt f, int64_t B, int64_t n, void* out, bool out_bf16) {
  const bool packed = ppq::formats::packed4(f);
  const int64_t nc = packed ? (n + 1) / 2 : n;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < nc; j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = packed ? 2 * j : j;
    const int64_t b = per_tensor ? 0 : i / B;
    const float s = scale_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(scales)[b])
                               : static_cast<const float*>(scales)[b];
    const uint8_t c = codes[j];
    if (!packed) {
      store(out, out_bf16, i, __fmul_rn(value(c, f), s));
    } else if (f == Fmt::I4) {
      store(out, out_bf16, i, __fmul_rn(float(int(c >> 4) - 8), s));
      if (i + 1 < n) store(out, out_bf16, i + 1, __fmul_rn(float(int(c & 15) - 8), s));
    } else {
      store(out, out_bf16, i, __fmul_rn(kNF4Code[c >> 4], s));
      if (i + 1 < n) store(out, out_bf16, i + 1, __fmul_rn(kNF4Code[c & 15], s));
    }
  }
}

int grid_for(int64_t work) {
  int64_t g = (work + 255) / 256;
  return int(g < 1 ? 1 : (g > 65535 ? 65535 : g));
}

}  // namespace

// Quantize n values of x (fp32, or bf16 if x_bf16) in blocks of B into codes and scales.
// per_tensor: one scale for all (fp8); given_scales: read fp32 scales instead of computing them.
// gmax_scratch: one uint32 of device memory (used for per_tensor only).
cudaError_t weight_quantize(const void* x, bool x_bf16, int64_t n, Fmt fmt, int64_t B, uint8_t* codes,
                            void* scales, bool scale_bf16, bool per_tensor, bool given_scales,
                            uint32_t* gmax_scratch, cudaStream_t stream) {
  const int64_t nb = n > 0 ? (n + B - 1) / B : 1;
  const bool one_scale = per_tensor && nb > 1;
  const int mode = given_scales ? (one_scale ? 3 : 2) : (one_scale ? 1 : 0);
  if (mode == 1) {
    cudaError_t e = cudaMemsetAsync(gmax_scratch, 0, sizeof(uint32_t), stream);
    if (e != cudaSuccess) return e;
    global_absmax_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, x_bf16, n, gmax_scratch);
  }
  quantize_kernel<<<dim3(unsigned(nb)), kThreads, 0, stream>>>(x, x_bf16, n, fmt, B, codes, scales, scale_bf16,
                                                               mode, gmax_scratch);
  return cudaGetLastError();
}

cudaError_t weight_dequantize(const uint8_t* codes, const void* scales, bool scale_bf16, bool per_tensor, Fmt fmt,
                              int64_t B, int64_t n, void* out, bool out_bf16, cudaStream_t stream) {
  dequantize_kernel<<<grid_for(n), 256, 0, stream>>>(codes, scales, scale_bf16, per_tensor, fmt, B, n, out,
                                                     out_bf16);
  return cudaGetLastError();
}

}  // namespace ppq_cuda
