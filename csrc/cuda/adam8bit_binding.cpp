// Torch binding of csrc/cuda/adam8bit.cu: ppq::adam8bit_blockwise_step_ on CUDA tensors.
// Built only where PyTorch has CUDA (setup.py). Checks mirror csrc/cpu/adam8bit.cpp's; each names the
// argument, the value and what is allowed.
#include <torch/library.h>

#include <cstdint>

#include "binding.h"

namespace {

using namespace ppq_cuda::binding;

constexpr int64_t kBlock = 256;  // bitsandbytes' blockwise optimizer block

void adam8bit_blockwise_step_cuda(at::Tensor& p, const at::Tensor& g, at::Tensor& state1, at::Tensor& state2,
                                  at::Tensor& absmax1, at::Tensor& absmax2, const at::Tensor& qmap1,
                                  const at::Tensor& qmap2, double beta1, double beta2, double eps, int64_t step,
                                  double lr, double weight_decay, double gnorm_scale) {
  const c10::Device dev = p.device();
  const int64_t n = p.numel(), nb = (n + kBlock - 1) / kBlock;
  check_buffer(p, "p", at::kFloat, n, dev);
  check_buffer(g, "g", at::kFloat, n, dev);
  check_buffer(state1, "state1", at::kByte, n, dev);
  check_buffer(state2, "state2", at::kByte, n, dev);
  check_buffer(absmax1, "absmax1", at::kFloat, nb, dev);
  check_buffer(absmax2, "absmax2", at::kFloat, nb, dev);
  check_buffer(qmap1, "qmap1", at::kFloat, 256, dev);
  check_buffer(qmap2, "qmap2", at::kFloat, 256, dev);
  TORCH_CHECK(step >= 1, "step=", step, " must be >= 1");
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ppq_cuda::adam8bit_blockwise_step(
                   p.data_ptr<float>(), g.data_ptr<float>(), state1.data_ptr<uint8_t>(), state2.data_ptr<uint8_t>(),
                   absmax1.data_ptr<float>(), absmax2.data_ptr<float>(), qmap1.data_ptr<float>(),
                   qmap2.data_ptr<float>(), n, beta1, beta2, eps, step, lr, weight_decay, gnorm_scale, stream(dev)),
               "adam8bit_blockwise_step_");
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CUDA, m) { m.impl("adam8bit_blockwise_step_", &adam8bit_blockwise_step_cuda); }
