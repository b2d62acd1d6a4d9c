// Torch binding of csrc/cuda/weights_sr.cu: ppq::weight_quantize_sr_out on CUDA tensors.
// Built only where PyTorch has CUDA (setup.py). Checks mirror csrc/cpu/weights_sr.cpp.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "binding.h"
#include "common/formats_torch.h"

namespace {

// The formats with a stochastic-rounding quantizer and their code dtypes: common/formats_torch.h.
using ppq::formats::code_type;
using ppq::formats::Fmt;

Fmt parse_sr_fmt(std::string_view f) {
  return ppq::formats::parse_sr_or_throw(f, "stochastic-rounding quantizer");
}

void weight_quantize_sr_out(const at::Tensor& x, c10::string_view fmt, int64_t B, int64_t seed, int64_t offset,
                            at::Tensor& codes, at::Tensor& scales) {
  const Fmt f = parse_sr_fmt(fmt);
  TORCH_CHECK(B >= 16 && B <= 4096 && (B & (B - 1)) == 0, "block_size=", B,
              " is not allowed: use a power of two in [16, 4096]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x has dtype ",
              x.scalar_type(), "; allowed: Float (fp32) or BFloat16");
  TORCH_CHECK(x.is_contiguous() && x.is_cuda(), "x must be a contiguous CUDA tensor");
  TORCH_CHECK(seed >= 0 && seed <= 0xffffffffLL, "seed=", seed, " is not allowed: use [0, 2^32)");
  TORCH_CHECK(offset >= 0, "offset=", offset, " is not allowed: use a non-negative counter");
  const int64_t n = x.numel();
  TORCH_CHECK(n > 0, "x is empty");
  const int64_t nb = (n + B - 1) / B;
  TORCH_CHECK(codes.scalar_type() == code_type(f) && codes.is_contiguous() && codes.is_cuda() &&
                  codes.numel() == n,
              "codes must be a contiguous CUDA ", code_type(f), " tensor of ", n, " elements, got ",
              codes.scalar_type(), " with ", codes.numel());
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16, "scales has dtype ",
              scales.scalar_type(), "; allowed: Float or BFloat16");
  const bool per_tensor = scales.numel() == 1 && nb > 1;
  TORCH_CHECK(scales.is_contiguous() && scales.is_cuda() &&
                  (scales.numel() == nb || (per_tensor && ppq::formats::per_tensor_scale(f))),
              "scales has ", scales.numel(), " elements; ", n, " values in blocks of ", B, " need ", nb);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor scratch = at::empty({1}, x.options().dtype(at::kInt));
  auto err = ppq_cuda::weight_quantize_sr(
      x.data_ptr(), x.scalar_type() == at::kBFloat16, n, f, B, static_cast<uint8_t*>(codes.data_ptr()),
      scales.data_ptr(), scales.scalar_type() == at::kBFloat16, per_tensor, static_cast<uint32_t>(seed),
      static_cast<uint64_t>(offset), static_cast<uint32_t*>(scratch.data_ptr()), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "weight_quantize_sr CUDA kernel failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CUDA, m) { m.impl("weight_quantize_sr_out", &weight_quantize_sr_out); }
