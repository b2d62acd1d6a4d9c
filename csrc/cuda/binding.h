// Input checks and launch helpers shared by the torch bindings of the CUDA kernels (csrc/cuda/*_binding.cpp).
//
// Lean headers only: ATen/core/Tensor.h for at::Tensor and c10/cuda for the current stream and the device
// guard (not ATen/cuda/CUDAContext.h, which pulls in cuBLAS/cuSPARSE/cuSOLVER headers the kernels do not
// need). Every check names the argument, the value it got and what is allowed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels.h"

namespace ppq_cuda::binding {

// t is a contiguous CUDA tensor on `device` (the device the op runs on: that of its first tensor).
inline void check_cuda(const at::Tensor& t, const char* name, const c10::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the op runs on ", device,
              ": every tensor of one call must be on the same GPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got sizes ", t.sizes(), " with strides ", t.strides());
}

// t is a contiguous CUDA tensor on `device` of dtype `dt` with `n` elements.
inline void check_buffer(const at::Tensor& t, const char* name, at::ScalarType dt, int64_t n,
                         const c10::Device& device) {
  check_cuda(t, name, device);
  TORCH_CHECK(t.scalar_type() == dt, name, " has dtype ", t.scalar_type(), "; needs ", dt);
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements; needs ", n);
}

// The kernels' code for a floating dtype: fp32, bf16 or fp16.
inline int float_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kDtF32;
    case at::kBFloat16: return kDtBF16;
    case at::kHalf: return kDtF16;
    default:
      TORCH_CHECK(false, name, " has dtype ", t.scalar_type(), "; allowed: Float (fp32), BFloat16 or Half (fp16)");
  }
}

// The 2-D [rows, cols] shape of a codec tensor, checked: `what` names the layout in the message.
inline void check_2d(const at::Tensor& t, const char* name, const char* what) {
  TORCH_CHECK(t.dim() == 2, name, " must be ", what, ", got shape ", t.sizes());
  TORCH_CHECK(t.size(1) <= INT32_MAX, name, " has ", t.size(1), " columns; the CUDA kernels take at most 2^31 - 1");
}

// The current CUDA stream of `device` (the caller holds a CUDAGuard for it).
inline cudaStream_t stream(const c10::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " CUDA kernel failed: ", cudaGetErrorString(err));
}

}  // namespace ppq_cuda::binding
