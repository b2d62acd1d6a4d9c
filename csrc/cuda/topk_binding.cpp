// Torch binding of csrc/cuda/topk.cu: ppq::topk_encode / ppq::topk_decode on CUDA tensors.
// Built only where PyTorch has CUDA (setup.py). Checks mirror csrc/cpu/codecs.cpp's; each names the argument,
// the value and what is allowed. topk_decode reads back one int (a device sync) to raise on an index
// outside [0, L), as the CPU kernel does.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>

#include "binding.h"

namespace {

using namespace ppq_cuda::binding;

void topk_encode_cuda(const at::Tensor& x, int64_t k, at::Tensor values, at::Tensor indices, at::Tensor status) {
  const c10::Device dev = x.device();
  check_cuda(x, "x", dev);
  check_2d(x, "x", "[B, L]");
  const int dt = float_code(x, "x");
  const int64_t B = x.size(0), L = x.size(1);
  TORCH_CHECK(k >= 1 && k <= L, "k must be in [1, L=", L, "], got ", k);
  check_buffer(values, "values", x.scalar_type(), B * k, dev);
  check_buffer(indices, "indices", at::kLong, B * k, dev);
  check_buffer(status, "status", at::kByte, 1, dev);
  const c10::cuda::CUDAGuard guard(dev);
  const size_t nbytes = ppq_cuda::topk_scratch_bytes(B, L, k);
  at::Tensor scratch = at::empty({int64_t(nbytes > 0 ? nbytes : 1)}, x.options().dtype(at::kByte));
  check_launch(ppq_cuda::topk_encode(x.data_ptr(), dt, B, L, k, values.data_ptr(), indices.data_ptr<int64_t>(),
                                     status.data_ptr<uint8_t>(), scratch.data_ptr(), stream(dev)),
               "topk_encode");
}

void topk_decode_cuda(const at::Tensor& values, const at::Tensor& indices, at::Tensor out) {
  const c10::Device dev = out.device();
  check_cuda(out, "out", dev);
  check_2d(out, "out", "[B, L]");
  const int dt = float_code(out, "out");
  const int64_t B = out.size(0), L = out.size(1);
  TORCH_CHECK(indices.dim() == 2 && indices.size(0) == B, "indices must be [B=", B, ", K], got ", indices.sizes());
  const int64_t k = indices.size(1);
  check_buffer(indices, "indices", at::kLong, B * k, dev);
  check_buffer(values, "values", out.scalar_type(), B * k, dev);
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor bad = at::zeros({1}, out.options().dtype(at::kInt));
  check_launch(ppq_cuda::topk_decode(values.data_ptr(), indices.data_ptr<int64_t>(), dt, B, L, k, out.data_ptr(),
                                     bad.data_ptr<int>(), stream(dev)),
               "topk_decode");
  const int nbad = bad.item<int>();
  TORCH_CHECK(nbad == 0, "indices must lie in [0, L=", L, "); ", nbad, " do not (they were skipped)");
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CUDA, m) {
  m.impl("topk_encode", &topk_encode_cuda);
  m.impl("topk_decode", &topk_decode_cuda);
}
