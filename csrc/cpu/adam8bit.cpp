// Adam/AdamW with blockwise 8-bit states (bitsandbytes' layout) on CPU: one fused pass per block.
//
// Design note.
// * The math is deepspeed_ppq/quant/adam8bit.py's reference, operation for operation in fp32: per
//   block of 256 values, states decoded through the 256-entry code maps and the block absmax, the Adam
//   update (decoupled weight decay; bitsandbytes' CUDA form m / (sqrt(v) + eps * sqrt(1 - beta2^t))
//   with the bias corrections in the step size: one division per value), the new block absmax, and the
//   states re-encoded to the NEAREST code (the count of code midpoints below m * (1 / absmax), the
//   reciprocal once per block as bitsandbytes' CUDA kernel does; a tie goes to the lower code). The
//   tests hold this kernel to the reference bit for bit.
// * Why: bitsandbytes' CPU backend runs the same algorithm as a dozen whole-tensor PyTorch ops plus a
//   binary-search quantizer, ~25 ns per parameter; the 8-bit states the autotuner wants for their
//   memory then cost more time than they save.
// * One pass over memory: a block's new states wait in two 1 KiB stack buffers (L1) between the update
//   and the encode. Blocks are independent: OpenMP hands them out 32 at a time over torch's intra-op
//   threads (at::get_num_threads(), the count torch's fused Adam uses too); dynamically, so a thread
//   the OS takes off its core (a shared machine, a data loader beside the step) does not hold the
//   others at the barrier.
// * The encode looks the nearest code up by the value's float bits instead of searching: the top 16
//   bits (sign, exponent, 7 mantissa bits) of y in [-1, 1] name a cell of width 2^-7 relative; for
//   bitsandbytes' maps no cell holds more than one midpoint (checked when the table is built), so the
//   code is (midpoints below the cell) + (y > the cell's midpoint). Both live in one 32-bit entry per
//   cell, and the comparison is the carry of a 16-bit addition (adam8bit.h): per value a shift, a min
//   (the cell index), one table read and an add. The table has an entry for every 16-bit prefix up to
//   -1.0 (49k entries, 192 KiB per map, built once per map and cached); the cells values fall into are a
//   few KiB of it. A map that breaks the one-midpoint rule falls back to a branch-free binary search.
// * Where the time goes (AVX2, Zen 3, one thread, 4M parameters, by removing one stage at a time from
//   the block loop): decoding the two states (a 256-entry table each) ~0.75 ns per parameter,
//   encoding them ~1.3 ns (before the one-entry cells and the shift-and-min index), the Adam arithmetic
//   with the memory traffic ~0.45 ns, of which the division and square root ~0.25 ns; torch's fused
//   fp32 Adam takes ~0.7 ns there. A 256-entry table has no in-register form on AVX2 (vpermps holds 8
//   entries, vpshufb 16 bytes), so each of the four look-ups per parameter is a memory read, and an
//   8-lane vgatherdps there costs more than eight scalar loads: the decode uses scalar loads, the
//   encode one gather of the cell entries. The earlier form divided by sqrt(1 - beta2^t) and by the
//   absmax per value: three more divisions per value.
// * With AVX-512 a block runs 16 values at a time (gathers for both tables), with AVX2 8. With VBMI
//   (the avx512vbmi module) the decode needs no gather: a 256-entry float table is four 256-entry
//   byte tables, and vpermi2b looks up 64 bytes at once in 128 (adam8bit.h decode64): ~22 operations
//   per 64 values against four 16-lane gathers. On Zen 5 (one thread, 4M parameters) the step went
//   from 1.35 to 0.87 ns per parameter so; the encode's two gathers per 16 values are ~0.45 of the
//   0.87 (measured by leaving them out), the rest the Adam arithmetic and the memory traffic. Their
//   table is not what costs: the cells below the map's smallest midpoint can share one entry, which
//   leaves ~3k cells per sign (23 KiB, in L1 beside the block's buffers, against 192 KiB in L2), and
//   the step measured the same with it (1.02-1.03 against 1.02-1.05 ns per parameter, alternating
//   runs, one thread, 4M parameters): the gathers' own issue rate (~11 cycles per 16 lanes) bounds the
//   encode, and with it the step at ~2x torch's fused fp32 Adam (0.44 ns, memory-bound) on one core.
// * Built with -ffp-contract=off (setup.py): products and sums round separately, as the reference's.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "isa.h"

#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
// GCC 12's false positive on the intrinsics' _mm512_undefined_*() placeholders (see weights.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "adam8bit.h"

#include <algorithm>
#include <cstdint>

namespace {

using ppq::adam8::kBlock;

void check_state(const at::Tensor& t, const char* name, at::ScalarType dt, int64_t n) {
  TORCH_CHECK(t.scalar_type() == dt, name, " has dtype ", t.scalar_type(), "; needs ", dt);
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements; needs ", n);
}

void adam8bit_blockwise_step_(at::Tensor& p, const at::Tensor& g, at::Tensor& state1, at::Tensor& state2,
                              at::Tensor& absmax1, at::Tensor& absmax2, const at::Tensor& qmap1,
                              const at::Tensor& qmap2, double beta1, double beta2, double eps, int64_t step,
                              double lr, double weight_decay, double gnorm_scale) {
  const int64_t n = p.numel(), nb = (n + kBlock - 1) / kBlock;
  check_state(p, "p", at::kFloat, n);
  check_state(g, "g", at::kFloat, n);
  check_state(state1, "state1", at::kByte, n);
  check_state(state2, "state2", at::kByte, n);
  check_state(absmax1, "absmax1", at::kFloat, nb);
  check_state(absmax2, "absmax2", at::kFloat, nb);
  check_state(qmap1, "qmap1", at::kFloat, 256);
  check_state(qmap2, "qmap2", at::kFloat, 256);
  TORCH_CHECK(step >= 1, "step=", step, " must be >= 1");
  const auto map1 = ppq::adam8::get_map(qmap1.data_ptr<float>());
  const auto map2 = ppq::adam8::get_map(qmap2.data_ptr<float>());
  const ppq::adam8::Map &m1 = *map1, &m2 = *map2;
  const ppq::adam8::Hyper h = ppq::adam8::make_hyper(beta1, beta2, eps, step, lr, weight_decay, gnorm_scale);
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  uint8_t* q1 = state1.data_ptr<uint8_t>();
  uint8_t* q2 = state2.data_ptr<uint8_t>();
  float* a1p = absmax1.data_ptr<float>();
  float* a2p = absmax2.data_ptr<float>();
#pragma omp parallel for num_threads(std::max(1, at::get_num_threads())) schedule(dynamic, 32) if (n > (1 << 16))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock;
    ppq::adam8::block_step(h, m1, m2, pp + i0, gp + i0, q1 + i0, q2 + i0, a1p + b, a2p + b,
                           std::min(kBlock, n - i0));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CPU, m) { m.impl("adam8bit_blockwise_step_", &adam8bit_blockwise_step_); }
