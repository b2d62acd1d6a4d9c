// Torch binding of csrc/cuda/codecs.cu: ppq::quant_encode / quant_decode / fp8_encode / fp8_decode on CUDA
// tensors (fp32, bf16 or fp16 activations, read and written in their own dtype).
// Built only where PyTorch has CUDA (setup.py). Checks mirror csrc/cpu/codecs.cpp's; each names the
// argument, the value and what is allowed.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#include "binding.h"

namespace {

using namespace ppq_cuda::binding;

int64_t packed_nbytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }
int64_t ngroups(int64_t R, int64_t d, int64_t group) { return R * ((d + group - 1) / group); }

void check_bits(int64_t bits) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 6 || bits == 8, "bits must be 2, 4, 6 or 8, got ", bits);
}
void check_group(int64_t group) { TORCH_CHECK(group >= 1, "group must be >= 1, got ", group); }
void check_fmt(int64_t fmt) { TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (e4m3) or 1 (e5m2), got ", fmt); }

void quant_encode_cuda(const at::Tensor& x, int64_t group, int64_t bits, at::Tensor mins, at::Tensor scales,
                       at::Tensor codes, at::Tensor status) {
  check_bits(bits);
  check_group(group);
  const c10::Device dev = x.device();
  check_cuda(x, "x", dev);
  check_2d(x, "x", "[R, d]");
  const int dt = float_code(x, "x");
  const int64_t R = x.size(0), d = x.size(1), G = ngroups(R, d, group);
  check_buffer(mins, "mins", at::kFloat, G, dev);
  check_buffer(scales, "scales", at::kFloat, G, dev);
  check_buffer(codes, "codes", at::kByte, packed_nbytes(R * d, bits), dev);
  check_buffer(status, "status", at::kByte, 1, dev);
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor scratch = at::empty({2 * G}, mins.options());  // per-group 1/range and prescale (unfused path)
  check_launch(ppq_cuda::quant_encode(x.data_ptr(), dt, R, d, group, int(bits), mins.data_ptr<float>(),
                                      scales.data_ptr<float>(), scratch.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                                      status.data_ptr<uint8_t>(), stream(dev)),
               "quant_encode");
}

void quant_decode_cuda(const at::Tensor& codes, const at::Tensor& mins, const at::Tensor& scales, int64_t group,
                       int64_t bits, at::Tensor out) {
  check_bits(bits);
  check_group(group);
  const c10::Device dev = out.device();
  check_cuda(out, "out", dev);
  check_2d(out, "out", "[R, d]");
  const int dt = float_code(out, "out");
  const int64_t R = out.size(0), d = out.size(1), G = ngroups(R, d, group);
  check_buffer(mins, "mins", at::kFloat, G, dev);
  check_buffer(scales, "scales", at::kFloat, G, dev);
  check_buffer(codes, "codes", at::kByte, packed_nbytes(R * d, bits), dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ppq_cuda::quant_decode(codes.data_ptr<uint8_t>(), mins.data_ptr<float>(), scales.data_ptr<float>(), R,
                                      d, group, int(bits), out.data_ptr(), dt, stream(dev)),
               "quant_decode");
}

void fp8_encode_cuda(const at::Tensor& x, int64_t group, int64_t fmt, at::Tensor scales, at::Tensor codes,
                     at::Tensor status) {
  check_fmt(fmt);
  check_group(group);
  const c10::Device dev = x.device();
  check_cuda(x, "x", dev);
  check_2d(x, "x", "[R, d]");
  const int dt = float_code(x, "x");
  const int64_t R = x.size(0), d = x.size(1);
  check_buffer(scales, "scales", at::kFloat, ngroups(R, d, group), dev);
  check_buffer(codes, "codes", at::kByte, R * d, dev);
  check_buffer(status, "status", at::kByte, 1, dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ppq_cuda::fp8_encode(x.data_ptr(), dt, R, d, group, int(fmt), scales.data_ptr<float>(),
                                    codes.data_ptr<uint8_t>(), status.data_ptr<uint8_t>(), stream(dev)),
               "fp8_encode");
}

void fp8_decode_cuda(const at::Tensor& codes, const at::Tensor& scales, int64_t group, int64_t fmt, at::Tensor out) {
  check_fmt(fmt);
  check_group(group);
  const c10::Device dev = out.device();
  check_cuda(out, "out", dev);
  check_2d(out, "out", "[R, d]");
  const int dt = float_code(out, "out");
  const int64_t R = out.size(0), d = out.size(1);
  check_buffer(scales, "scales", at::kFloat, ngroups(R, d, group), dev);
  check_buffer(codes, "codes", at::kByte, R * d, dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ppq_cuda::fp8_decode(codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), R, d, group, int(fmt),
                                    out.data_ptr(), dt, stream(dev)),
               "fp8_decode");
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CUDA, m) {
  m.impl("quant_encode", &quant_encode_cuda);
  m.impl("quant_decode", &quant_decode_cuda);
  m.impl("fp8_encode", &fp8_encode_cuda);
  m.impl("fp8_decode", &fp8_decode_cuda);
}
