// Torch binding of csrc/cuda/bitpack.cu: ppq::pack_bits / ppq::unpack_bits on CUDA tensors.
// Built only where PyTorch has CUDA (setup.py). Checks mirror csrc/cpu/codecs.cpp's.
#include <torch/library.h>

#include <cstdint>

#include "binding.h"

namespace {

using namespace ppq_cuda::binding;

int64_t packed_nbytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }

void check_bits(int64_t bits) { TORCH_CHECK(bits >= 1 && bits <= 56, "bits must be in [1, 56], got ", bits); }

void pack_bits_cuda(const at::Tensor& idx, int64_t bits, at::Tensor out) {
  check_bits(bits);
  const c10::Device dev = idx.device();
  check_cuda(idx, "idx", dev);
  TORCH_CHECK(idx.scalar_type() == at::kLong, "idx has dtype ", idx.scalar_type(), "; needs Long (int64)");
  const int64_t n = idx.numel();
  check_buffer(out, "out", at::kByte, packed_nbytes(n, bits), dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ppq_cuda::pack_bits(idx.data_ptr<int64_t>(), n, int(bits), out.data_ptr<uint8_t>(), stream(dev)),
               "pack_bits");
}

void unpack_bits_cuda(const at::Tensor& packed, int64_t bits, at::Tensor out) {
  check_bits(bits);
  const c10::Device dev = out.device();
  check_cuda(out, "out", dev);
  TORCH_CHECK(out.scalar_type() == at::kLong, "out has dtype ", out.scalar_type(), "; needs Long (int64)");
  const int64_t n = out.numel();
  check_buffer(packed, "packed", at::kByte, packed_nbytes(n, bits), dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(
      ppq_cuda::unpack_bits(packed.data_ptr<uint8_t>(), n, int(bits), out.data_ptr<int64_t>(), stream(dev)),
      "unpack_bits");
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CUDA, m) {
  m.impl("pack_bits", &pack_bits_cuda);
  m.impl("unpack_bits", &unpack_bits_cuda);
}
