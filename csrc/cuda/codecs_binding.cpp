// Torch binding of csrc/cuda/codecs.cu: ppq::quant_encode / ppq::quant_decode on CUDA tensors.
// Built only where PyTorch has CUDA (setup.py). bf16/fp16 inputs are widened to fp32 first (the kernels
// are fp32); FP8 and TopK keep the plain-PyTorch reference on CUDA for now.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <cstdint>

namespace ppq_cuda {
cudaError_t quant_encode_f32(const float* x, int64_t R, int64_t d, int64_t group, int bits, float* mins,
                             float* scales, float* invs, float* pres, uint8_t* codes, int* bad,
                             cudaStream_t stream);
cudaError_t quant_decode_f32(const uint8_t* codes, const float* mins, const float* scales, int64_t R, int64_t d,
                             int64_t group, int bits, float* out, cudaStream_t stream);
}  // namespace ppq_cuda

namespace {

int64_t packed_nbytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }

void check_buf(const at::Tensor& t, at::ScalarType dt, int64_t n, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == dt && t.is_contiguous() && t.numel() == n, name,
              " must be a contiguous CUDA ", dt, " tensor of ", n, " elements, got ", t.scalar_type(), " ",
              t.sizes());
}

void quant_encode_cuda(const at::Tensor& x, int64_t group, int64_t bits, at::Tensor mins, at::Tensor scales,
                       at::Tensor codes, at::Tensor status) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 6 || bits == 8, "bits must be 2, 4, 6 or 8, got ", bits);
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "x must be a 2-D CUDA tensor [R, d], got ", x.sizes());
  TORCH_CHECK(group >= 1, "group must be >= 1, got ", group);
  const int64_t R = x.size(0), d = x.size(1), G = R * ((d + group - 1) / group);
  check_buf(mins, at::kFloat, G, "mins");
  check_buf(scales, at::kFloat, G, "scales");
  check_buf(codes, at::kByte, packed_nbytes(R * d, bits), "codes");
  check_buf(status, at::kByte, 1, "status");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor scratch = at::empty({2 * G}, xf.options());
  at::Tensor bad = at::empty({1}, xf.options().dtype(at::kInt));
  auto err = ppq_cuda::quant_encode_f32(xf.data_ptr<float>(), R, d, group, int(bits), mins.data_ptr<float>(),
                                        scales.data_ptr<float>(), scratch.data_ptr<float>(),
                                        scratch.data_ptr<float>() + G, codes.data_ptr<uint8_t>(),
                                        bad.data_ptr<int>(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "quant_encode CUDA kernel failed: ", cudaGetErrorString(err));
  status.copy_(bad.to(at::kByte));
}

void quant_decode_cuda(const at::Tensor& codes, const at::Tensor& mins, const at::Tensor& scales, int64_t group,
                       int64_t bits, at::Tensor out) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 6 || bits == 8, "bits must be 2, 4, 6 or 8, got ", bits);
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.is_contiguous(), "out must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(group >= 1, "group must be >= 1, got ", group);
  const int64_t R = out.size(0), d = out.size(1), G = R * ((d + group - 1) / group);
  check_buf(mins, at::kFloat, G, "mins");
  check_buf(scales, at::kFloat, G, "scales");
  check_buf(codes, at::kByte, packed_nbytes(R * d, bits), "codes");
  at::Tensor of = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  auto err = ppq_cuda::quant_decode_f32(codes.data_ptr<uint8_t>(), mins.data_ptr<float>(), scales.data_ptr<float>(),
                                        R, d, group, int(bits), of.data_ptr<float>(),
                                        at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "quant_decode CUDA kernel failed: ", cudaGetErrorString(err));
  if (!of.is_same(out)) out.copy_(of);
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CUDA, m) {
  m.impl("quant_encode", &quant_encode_cuda);
  m.impl("quant_decode", &quant_decode_cuda);
}
