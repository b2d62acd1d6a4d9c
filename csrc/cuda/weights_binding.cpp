// Torch binding of csrc/cuda/weights.cu: the ppq::weight_* ops on CUDA tensors.
// Built only where PyTorch has CUDA (setup.py). Checks mirror csrc/cpu/weights.cpp: each names the
// argument, the value and what is allowed.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "binding.h"
#include "common/formats_torch.h"

namespace {

// The formats, their names, code dtypes, packing and per-tensor scales: common/formats.h (generated from
// deepspeed_ppq/formats.py) and common/formats_torch.h, as the CPU kernels.
using ppq::formats::code_type;
using ppq::formats::Fmt;
using ppq::formats::packed4;
using ppq::formats::per_tensor_scale;

Fmt parse_fmt(std::string_view f) { return ppq::formats::parse_or_throw(f); }
int64_t nblocks(int64_t n, int64_t B) { return std::max<int64_t>(1, (n + B - 1) / B); }
int64_t ncodes(Fmt f, int64_t n) { return packed4(f) ? (n + 1) / 2 : n; }

void check_block(int64_t B) {
  TORCH_CHECK(B >= 16 && B <= 4096 && (B & (B - 1)) == 0, "block_size=", B,
              " is not allowed: use a power of two in [16, 4096]");
}
void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " has dtype ",
              t.scalar_type(), "; allowed: Float (fp32) or BFloat16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.numel() > 0, name, " is empty");
}
void check_codes(const at::Tensor& c, Fmt f, int64_t n) {
  TORCH_CHECK(c.scalar_type() == code_type(f), "codes has dtype ", c.scalar_type(), "; this format needs ",
              code_type(f));
  TORCH_CHECK(c.is_contiguous() && c.is_cuda(), "codes must be a contiguous CUDA tensor");
  TORCH_CHECK(c.numel() == ncodes(f, n), "codes has ", c.numel(), " elements; ", n, " values need ",
              ncodes(f, n));
}
void check_scales(const at::Tensor& s, Fmt f, int64_t n, int64_t B, bool fp32_only) {
  TORCH_CHECK(s.scalar_type() == at::kFloat || (!fp32_only && s.scalar_type() == at::kBFloat16),
              "scales has dtype ", s.scalar_type(), "; allowed: Float", fp32_only ? "" : " or BFloat16");
  TORCH_CHECK(s.is_contiguous() && s.is_cuda(), "scales must be a contiguous CUDA tensor");
  const int64_t nb = nblocks(n, B);
  TORCH_CHECK(s.numel() == nb || (per_tensor_scale(f) && s.numel() == 1), "scales has ", s.numel(), " elements; ",
              n, " values in blocks of ", B, " need ", nb,
              per_tensor_scale(f) ? " (or 1 for a per-tensor fp8 scale)" : "");
}

void run_quantize(const at::Tensor& x, Fmt f, int64_t B, at::Tensor& codes, at::Tensor& scales, bool given) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor scratch = at::empty({1}, x.options().dtype(at::kInt));
  auto err = ppq_cuda::weight_quantize(
      x.data_ptr(), x.scalar_type() == at::kBFloat16, x.numel(), f, B, static_cast<uint8_t*>(codes.data_ptr()),
      scales.data_ptr(), scales.scalar_type() == at::kBFloat16, scales.numel() == 1, given,
      static_cast<uint32_t*>(scratch.data_ptr()), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "weight_quantize CUDA kernel failed: ", cudaGetErrorString(err));
}

void weight_quantize_out(const at::Tensor& x, c10::string_view fmt, int64_t B, at::Tensor& codes,
                         at::Tensor& scales) {
  const Fmt f = parse_fmt(fmt);
  check_block(B);
  check_float(x, "x");
  check_codes(codes, f, x.numel());
  check_scales(scales, f, x.numel(), B, false);
  run_quantize(x, f, B, codes, scales, false);
}

void weight_quantize_codes_out(const at::Tensor& x, const at::Tensor& scales, c10::string_view fmt, int64_t B,
                               at::Tensor& codes) {
  const Fmt f = parse_fmt(fmt);
  check_block(B);
  check_float(x, "x");
  check_codes(codes, f, x.numel());
  check_scales(scales, f, x.numel(), B, true);
  at::Tensor s = scales;
  run_quantize(x, f, B, codes, s, true);
}

void weight_dequantize_out(const at::Tensor& codes, const at::Tensor& scales, c10::string_view fmt, int64_t B,
                           at::Tensor& out) {
  const Fmt f = parse_fmt(fmt);
  check_block(B);
  check_float(out, "out");
  const int64_t n = out.numel();
  check_codes(codes, f, n);
  check_scales(scales, f, n, B, false);
  const c10::cuda::CUDAGuard guard(out.device());
  auto err = ppq_cuda::weight_dequantize(static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(),
                                         scales.scalar_type() == at::kBFloat16, scales.numel() == 1, f, B, n,
                                         out.data_ptr(), out.scalar_type() == at::kBFloat16,
                                         c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "weight_dequantize CUDA kernel failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> weight_quantize(const at::Tensor& x, c10::string_view fmt, int64_t B,
                                                   at::ScalarType scale_dtype, bool per_tensor) {
  const Fmt f = parse_fmt(fmt);
  check_block(B);
  TORCH_CHECK(scale_dtype == at::kFloat || scale_dtype == at::kBFloat16, "scale_dtype=", scale_dtype,
              " is not allowed: use Float or BFloat16");
  TORCH_CHECK(!per_tensor || per_tensor_scale(f), "per_tensor=True is only for fp8 formats, got fmt=",
              std::string(fmt));
  const int64_t n = x.numel();
  at::Tensor codes = at::empty({ncodes(f, n)}, x.options().dtype(code_type(f)));
  at::Tensor scales = at::empty({per_tensor ? 1 : nblocks(n, B)}, x.options().dtype(scale_dtype));
  weight_quantize_out(x, fmt, B, codes, scales);
  return {codes, scales};
}

at::Tensor weight_dequantize(const at::Tensor& codes, const at::Tensor& scales, c10::string_view fmt, int64_t B,
                             at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype=", dtype,
              " is not allowed: use Float or BFloat16");
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  weight_dequantize_out(codes, scales, fmt, B, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CUDA, m) {
  m.impl("weight_quantize_out", &weight_quantize_out);
  m.impl("weight_quantize_codes_out", &weight_quantize_codes_out);
  m.impl("weight_dequantize_out", &weight_dequantize_out);
  m.impl("weight_quantize", &weight_quantize);
  m.impl("weight_dequantize", &weight_dequantize);
}
