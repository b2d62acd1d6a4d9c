// Stochastic-rounding blockwise quantization of weights to int8 / fp8 e4m3 / fp8 e5m2 on CPU.
//
// Design note.
// * The math is the one written in deepspeed_ppq/quant/sr_ops.py, bit for bit given the same (seed,
//   offset): scales as the deterministic weight quantizer (absmax / Q rounded to fp32 or bf16, or one
//   scale for the whole tensor), a counter-based hash per element for the random bits (no generator
//   state: element i uses counter offset + i, so blocks run in any order on any thread), and the
//   round-up test u * (hi - lo) < a - lo on the magnitude, exact in fp32.
// * Used once per optimizer step per master-free layer (dequantize -> update -> this), so it is a
//   single read of memory: runs of 4096 values (whole blocks), each run's block scales first (absmax,
//   scale, inverse: short independent chains side by side), then the run's codes from cache while the
//   next run is prefetched (weights_sr.h). Runs are independent; OpenMP hands them out dynamically. A
//   per-tensor fp8 scale needs the global absmax first (one extra read pass). The random numbers: the
//   64-bit counter is a run base plus a carry, so its high word's hash is one of two values per run.
// * With AVX-512 the absmax and the encodes run 16 values at a time in explicit loops, with AVX2 8 at a
//   time (isa.h picks per module; the scalar loops stay for block tails and the scalar module). GCC had
//   left them scalar, with a branch on the random sign: ~7 ns per value for int8 and ~20 for fp8. Both
//   vector paths make the random numbers in-register beside the codes (weights_sr.h's encode_fused_avx2 /
//   encode_fused_avx512). The absmax, the fp8
//   round-to-nearest-even code and the neighbours' values come from avx512.h / avx2.h, shared with
//   weights.cpp; tests/quant/test_master_free.py holds every path to the reference bit for bit.
// * The work on a run (scales, codes) lives in weights_sr.h with a run-local interface (the run's first
//   value, code and random counter), so master_free.cpp runs it on values it has just updated in a
//   stack buffer (there without the prefetch).
// * fp8 neighbours (scalar) come from the round-to-nearest-even code (c10's own fp32 -> fp8 recipe, the
//   one torch's cast uses, in its branch-free form shared through fp8.h) and the code one below or above
//   it: fp8 codes of one sign order like their magnitudes. The AVX2 and AVX-512 paths cut the value's
//   mantissa to the format's bits instead (the same neighbours, half the operations: weights_sr.h's
//   sr_fp8_8 / sr_fp8_16); tests/quant/test_master_free.py runs every fp8 value and its neighbours
//   through each path.
// * A block holding NaN/Inf gets a NaN scale and zero codes; the Python front end raises.
// * Kept apart from weights.cpp (another concern's file); the scalar helpers repeat on purpose, the
//   vector ones are shared through avx512.h / avx2.h.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include "common/formats_torch.h"
#include "isa.h"

#if PPQ_ISA_AVX512 || PPQ_ISA_AVX2
// GCC 12's false positive on the intrinsics' _mm512_undefined_*() placeholders (see weights.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "weights_sr.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace {

using ppq::sr::Fmt;

using ppq::formats::code_type;

Fmt parse_sr_fmt(std::string_view f) {
  return ppq::formats::parse_sr_or_throw(f, "stochastic-rounding quantizer");
}

inline int threads() { return std::max(1, at::get_num_threads()); }

void weight_quantize_sr_out(const at::Tensor& x, c10::string_view fmt, int64_t B, int64_t seed, int64_t offset,
                            at::Tensor& codes, at::Tensor& scales) {
  const Fmt f = parse_sr_fmt(fmt);
  TORCH_CHECK(B >= 16 && B <= 4096 && (B & (B - 1)) == 0, "block_size=", B,
              " is not allowed: use a power of two in [16, 4096]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x has dtype ",
              x.scalar_type(), "; allowed: Float (fp32) or BFloat16");
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(seed >= 0 && seed <= 0xffffffffLL, "seed=", seed, " is not allowed: use [0, 2^32)");
  TORCH_CHECK(offset >= 0, "offset=", offset, " is not allowed: use a non-negative counter");
  const int64_t n = x.numel();
  TORCH_CHECK(n > 0, "x is empty");
  const int64_t nb = (n + B - 1) / B;
  TORCH_CHECK(codes.scalar_type() == code_type(f) && codes.is_contiguous() && codes.numel() == n,
              "codes must be a contiguous ", code_type(f), " tensor of ", n, " elements, got ",
              codes.scalar_type(), " with ", codes.numel());
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16,
              "scales has dtype ", scales.scalar_type(), "; allowed: Float or BFloat16");
  const bool per_tensor = scales.numel() == 1 && nb > 1;
  const bool tensor_ok = ppq::formats::per_tensor_scale(f);
  TORCH_CHECK(scales.is_contiguous() && (scales.numel() == nb || (per_tensor && tensor_ok)),
              "scales has ", scales.numel(), " elements; ", n, " values in blocks of ", B, " need ", nb,
              tensor_ok ? " (or 1 for a per-tensor fp8 scale)" : "");
  const bool xbf = x.scalar_type() == at::kBFloat16;
  const bool sbf = scales.scalar_type() == at::kBFloat16;
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t es = x.element_size();
  auto* cp = static_cast<uint8_t*>(codes.data_ptr());
  const uint32_t key = ppq::sr::hash32(static_cast<uint32_t>(seed));
  const uint64_t off = static_cast<uint64_t>(offset);
  const float qmax = ppq::sr::qmax(f);
  void* const sp = scales.data_ptr();
  const bool par = n > (1 << 15);  // small tensors stay on one thread
  // blocks handed out dynamically, ~8k values at a time: a thread the OS takes off its core does not hold
  // the others at the barrier
  const int64_t chunk = std::max<int64_t>(1, 8192 / B);
  if (per_tensor) {
    bool bad = false;
    float m = 0.0f;
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(dynamic, chunk) reduction(max : m) reduction(|| : bad)
    for (int64_t b = 0; b < nb; ++b) {
      bool bb;
      const int64_t i0 = b * B;
      const void* xb = xp + i0 * es;
      m = std::max(m, ppq::sr::block_absmax(xb, xbf, std::min(n, i0 + B) - i0, &bb));
      bad = bad || bb;
    }
    const float s = ppq::sr::stored_scale(m, bad, qmax, sbf);
    ppq::sr::store_scales(sp, sbf, 0, &s, 1);
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(dynamic, chunk)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i0 = b * B, len = std::min(n, i0 + B) - i0;
      const void* xb = xp + i0 * es;
      const uint64_t c0 = off + static_cast<uint64_t>(i0);
      if (xbf) ppq::sr::encode<true>(f, xb, len, s, c0, key, cp + i0);
      else ppq::sr::encode<false>(f, xb, len, s, c0, key, cp + i0);
    }
    return;
  }
  // runs of kRun values (whole blocks: B divides it): their scales first, then their codes (weights_sr.h)
  const int64_t R = ppq::sr::kRun, nr = (n + R - 1) / R;
#pragma omp parallel for num_threads(par ? threads() : 1) schedule(dynamic, std::max<int64_t>(1, 8192 / R))
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i0 = r * R, len = std::min(n, i0 + R) - i0;
    const void* xr = xp + i0 * es;
    const uint64_t c0 = off + static_cast<uint64_t>(i0);
    float sc[ppq::sr::kRun / 16];
    if (xbf) ppq::sr::quantize_blocks<true>(f, xr, len, B, sbf, c0, key, cp + i0, sc);
    else ppq::sr::quantize_blocks<false>(f, xr, len, B, sbf, c0, key, cp + i0, sc);
    ppq::sr::store_scales(sp, sbf, i0 / B, sc, (len + B - 1) / B);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CPU, m) { m.impl("weight_quantize_sr_out", &weight_quantize_sr_out); }
