// Host entry points of the CUDA kernels (csrc/cuda/*.cu), declared once for the kernels that define them
// and the torch bindings (csrc/cuda/*_binding.cpp) that call them.
//
// Plain C++ over the CUDA runtime API (raw pointers, a cudaStream_t, a cudaError_t back): no torch and
// no device code, so the .cu files compile with nvcc alone and the bindings with the host compiler.
// Every entry point only enqueues work on `stream` (no synchronisation) unless its comment says so;
// the bindings validate shapes, dtypes and devices before calling, the kernels trust them.
// tests/ops/test_cuda_compiles.py checks that every ppq_cuda:: symbol a binding uses is defined by a .cu file.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/formats.h"

namespace ppq_cuda {

// Floating-point element types of the codec kernels (the torch dtype of x / out).
enum FloatCode : int { kDtF32 = 0, kDtBF16 = 1, kDtF16 = 2 };

// ---- codecs.cu: stage-boundary codecs (deepspeed_ppq/compress/ops.py) ------------------------------
// x: [R, d] (dt); mins, scales: R * ceil(d / group) fp32; codes: ceil(R * d * bits / 8) bytes; status: one
// byte, set to 1 when x holds a NaN or an Inf, else 0. scratch: 2 * R * ceil(d / group) floats.
cudaError_t quant_encode(const void* x, int dt, int64_t R, int64_t d, int64_t group, int bits, float* mins,
                         float* scales, float* scratch, uint8_t* codes, uint8_t* status, cudaStream_t stream);
// out: [R, d] (dt).
cudaError_t quant_decode(const uint8_t* codes, const float* mins, const float* scales, int64_t R, int64_t d,
                         int64_t group, int bits, void* out, int dt, cudaStream_t stream);
// fmt 0: e4m3fn, 1: e5m2. scales: R * ceil(d / group) fp32; codes: R * d bytes; status as quant_encode.
cudaError_t fp8_encode(const void* x, int dt, int64_t R, int64_t d, int64_t group, int fmt, float* scales,
                       uint8_t* codes, uint8_t* status, cudaStream_t stream);
cudaError_t fp8_decode(const uint8_t* codes, const float* scales, int64_t R, int64_t d, int64_t group, int fmt,
                       void* out, int dt, cudaStream_t stream);

// ---- topk.cu: TopK per row ---------------------------------------------------------------------------
// Bytes of device scratch topk_encode needs for [B, L] and k (the caller allocates; no zeroing needed).
size_t topk_scratch_bytes(int64_t B, int64_t L, int64_t k);
// x: [B, L] (dt), 1 <= k <= L < 2^31; values: [B, k] (dt); indices: [B, k] int64 (ascending per row).
cudaError_t topk_encode(const void* x, int dt, int64_t B, int64_t L, int64_t k, void* values, int64_t* indices,
                        uint8_t* status, void* scratch, cudaStream_t stream);
// out: [B, L] (dt) = 0 except out[b, indices[b, j]] = values[b, j]. *bad (one device int) is set to the
// number of indices outside [0, L) (those are skipped); the caller reads it.
cudaError_t topk_decode(const void* values, const int64_t* indices, int dt, int64_t B, int64_t L, int64_t k,
                        void* out, int* bad, cudaStream_t stream);

// ---- bitpack.cu: little-endian bit stream of `bits` (1..56) bits per value ---------------------------
cudaError_t pack_bits(const int64_t* idx, int64_t n, int bits, uint8_t* out, cudaStream_t stream);
cudaError_t unpack_bits(const uint8_t* packed, int64_t n, int bits, int64_t* out, cudaStream_t stream);

// ---- adam8bit.cu: one Adam/AdamW step with bitsandbytes' blockwise 8-bit states ----------------------
// n values; absmax1/absmax2: ceil(n / 256); qmap1/qmap2: 256 fp32 each (ascending).
cudaError_t adam8bit_blockwise_step(float* p, const float* g, uint8_t* state1, uint8_t* state2, float* absmax1,
                                    float* absmax2, const float* qmap1, const float* qmap2, int64_t n,
                                    double beta1, double beta2, double eps, int64_t step, double lr,
                                    double weight_decay, double gnorm_scale, cudaStream_t stream);

// ---- weights.cu: blockwise low-bit weight formats ----------------------------------------------------
// fmt: any format of common/formats.h. per_tensor: one scale for all (formats::per_tensor_scale);
// given_scales: read fp32 scales instead of computing them. gmax_scratch: one uint32 of device memory.
cudaError_t weight_quantize(const void* x, bool x_bf16, int64_t n, ppq::formats::Fmt fmt, int64_t B,
                            uint8_t* codes, void* scales, bool scale_bf16, bool per_tensor, bool given_scales,
                            uint32_t* gmax_scratch, cudaStream_t stream);
cudaError_t weight_dequantize(const uint8_t* codes, const void* scales, bool scale_bf16, bool per_tensor,
                              ppq::formats::Fmt fmt, int64_t B, int64_t n, void* out, bool out_bf16,
                              cudaStream_t stream);

// ---- weights_sr.cu: stochastic-rounding quantize (fmt: a format with formats::has_sr) ---------------------
cudaError_t weight_quantize_sr(const void* x, bool x_bf16, int64_t n, ppq::formats::Fmt fmt, int64_t B,
                               uint8_t* codes,
                               void* scales, bool scale_bf16, bool per_tensor, uint32_t seed, uint64_t offset,
                               uint32_t* gmax_scratch, cudaStream_t stream);

}  // namespace ppq_cuda
