// The master-free update of one layer, fused: dequantize -> AdamW -> stochastic-rounding re-quantize,
// one pass over the layer (ppq::master_free_adamw_step_; deepspeed_ppq/quant/master_free.py).
//
// Design note.
// * The math is the reference's (master_free.py's _master_free_step_ref), operation for operation:
//   the weight quantizer's dequantize (code value x block scale, fp32), then AdamW with either fp32
//   moments or bitsandbytes' blockwise 8-bit states (adam8bit.h, the 8-bit Adam op's own block code),
//   then the SR quantizer (weights_sr.h, the SR op's own block code, same seed and counter). The tests
//   hold the kernel to the reference bit for bit on every path.
// * Why fused: done as three ops, the update allocated a dense fp32 copy of the layer per step and
//   streamed it through memory three times (written by the dequantize, read and written by the
//   optimizer, read by the quantizer), plus the fp32-moment path's seven whole-tensor PyTorch ops.
//   Here a chunk of max(block_size, 256) values (a whole number of scale blocks and of 256-value
//   optimizer blocks) is dequantized into a stack buffer (16 KiB at most: L1), updated there and
//   re-quantized from there: the layer's bytes cross memory once (codes, scales, gradient and states in;
//   codes, scales and states out), and nothing is allocated. A bf16 gradient buffer (WeightsConfig
//   grad_dtype) is widened chunk by chunk into a second stack buffer.
// * Chunks are independent (the SR counter of value i is offset + i whatever the order): OpenMP hands
//   them out dynamically, 4 at a time, over torch's intra-op threads.
// * Only per-block scales (a per-tensor fp8 scale needs the whole tensor's absmax before any code: the
//   Python front end runs the three ops for such layers).
// * Built with -ffp-contract=off (setup.py): products and sums round separately, as the reference's.
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
#include "adam8bit.h"
#include "fp8.h"
#include "weights_sr.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace {

using ppq::sr::Fmt;

// The update re-quantizes with stochastic rounding: the formats that have it (common/formats_torch.h).
Fmt parse_fmt(std::string_view f) { return ppq::formats::parse_sr_or_throw(f, "master-free update"); }
using ppq::formats::code_type;

void check(const at::Tensor& t, const char* name, at::ScalarType dt, int64_t n) {
  TORCH_CHECK(t.scalar_type() == dt, name, " has dtype ", t.scalar_type(), "; needs ", dt);
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements; needs ", n);
}

// w[0 .. len) = value(code) * s: the weight quantizer's dequantize of one scale block.
template <Fmt F>
inline void dequantize_block(const uint8_t* __restrict c, float s, float* __restrict w, int64_t len) {
  int64_t j = 0;
#if PPQ_HAS_AVX2  // the avx512 module too: no AVX-512 version of this loop
  const __m256 vs = _mm256_set1_ps(s);
  for (; j + 8 <= len; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
    __m256 v;
    if constexpr (F == Fmt::I8) v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    else v = ppq::avx2::fp8_decode8<F == Fmt::E4M3>(_mm256_cvtepu8_epi32(b));
    _mm256_storeu_ps(w + j, _mm256_mul_ps(v, vs));
  }
#endif
  for (; j < len; ++j) {
    float v;
    if constexpr (F == Fmt::I8) v = static_cast<float>(static_cast<int8_t>(c[j]));
    else if constexpr (F == Fmt::E4M3) v = ppq::fp8::e4m3_to_f32(c[j]);
    else v = ppq::fp8::e5m2_to_f32(c[j]);
    w[j] = v * s;
  }
}

// AdamW with fp32 moments on len values (adam8bit.h's block_step without the codes).
inline void adamw_fp32(const ppq::adam8::Hyper& h, float* __restrict w, const float* __restrict g,
                       float* __restrict m, float* __restrict v, int64_t len) {
  int64_t j = 0;
#if PPQ_ISA_AVX512
  {
    const __m512 vb1 = _mm512_set1_ps(h.b1), vb2 = _mm512_set1_ps(h.b2), vob1 = _mm512_set1_ps(h.ob1);
    const __m512 vob2 = _mm512_set1_ps(h.ob2), veps = _mm512_set1_ps(h.eps2), vgs = _mm512_set1_ps(h.gs);
    const __m512 vdecay = _mm512_set1_ps(h.decay), vstep = _mm512_set1_ps(h.step_size);
    for (; j + 16 <= len; j += 16) {
      __m512 gi = _mm512_loadu_ps(g + j);
      if (h.scale_g) gi = _mm512_mul_ps(gi, vgs);
      const __m512 m1 = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(m + j), vb1), _mm512_mul_ps(gi, vob1));
      const __m512 v1 = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + j), vb2),
                                      _mm512_mul_ps(_mm512_mul_ps(gi, gi), vob2));
      _mm512_storeu_ps(m + j, m1);
      _mm512_storeu_ps(v + j, v1);
      __m512 x = _mm512_loadu_ps(w + j);
      if (h.wd) x = _mm512_mul_ps(x, vdecay);
      const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v1), veps);
      _mm512_storeu_ps(w + j, _mm512_add_ps(x, _mm512_mul_ps(vstep, _mm512_div_ps(m1, denom))));
    }
  }
#elif PPQ_ISA_AVX2
  {
    const __m256 vb1 = _mm256_set1_ps(h.b1), vb2 = _mm256_set1_ps(h.b2), vob1 = _mm256_set1_ps(h.ob1);
    const __m256 vob2 = _mm256_set1_ps(h.ob2), veps = _mm256_set1_ps(h.eps2), vgs = _mm256_set1_ps(h.gs);
    const __m256 vdecay = _mm256_set1_ps(h.decay), vstep = _mm256_set1_ps(h.step_size);
    for (; j + 8 <= len; j += 8) {
      __m256 gi = _mm256_loadu_ps(g + j);
      if (h.scale_g) gi = _mm256_mul_ps(gi, vgs);
      const __m256 m1 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + j), vb1), _mm256_mul_ps(gi, vob1));
      const __m256 v1 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + j), vb2),
                                      _mm256_mul_ps(_mm256_mul_ps(gi, gi), vob2));
      _mm256_storeu_ps(m + j, m1);
      _mm256_storeu_ps(v + j, v1);
      __m256 x = _mm256_loadu_ps(w + j);
      if (h.wd) x = _mm256_mul_ps(x, vdecay);
      const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v1), veps);
      _mm256_storeu_ps(w + j, _mm256_add_ps(x, _mm256_mul_ps(vstep, _mm256_div_ps(m1, denom))));
    }
  }
#endif
  for (; j < len; ++j) {
    const float gi = h.scale_g ? g[j] * h.gs : g[j];
    const float m1 = m[j] * h.b1 + gi * h.ob1;
    const float v1 = v[j] * h.b2 + gi * gi * h.ob2;
    m[j] = m1;
    v[j] = v1;
    float x = w[j];
    if (h.wd) x = x * h.decay;
    w[j] = x + h.step_size * (m1 / (std::sqrt(v1) + h.eps2));
  }
}

// out[0 .. len) = x as fp32: exact (a bf16 is the top half of an fp32); a plain loop the compiler
// vectorizes (zero extension and a shift).
inline void widen_bf16(const c10::BFloat16* __restrict x, float* __restrict out, int64_t len) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(x);
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  for (int64_t j = 0; j < len; ++j) o[j] = static_cast<uint32_t>(b[j]) << 16;
}

template <Fmt F>
void run(uint8_t* codes, void* scales, bool sbf, int64_t B, int64_t n, const void* gv, bool gbf, void* s1, void* s2,
         float* a1, float* a2, const ppq::adam8::Map* m1, const ppq::adam8::Map* m2,
         const ppq::adam8::Hyper& h, uint32_t key, uint64_t offset) {
  constexpr int64_t kOpt = ppq::adam8::kBlock;
  const int64_t C = std::max(B, kOpt), nchunks = (n + C - 1) / C;
  const bool states8 = m1 != nullptr;
  auto scale_at = [&](int64_t b) {
    return sbf ? static_cast<float>(static_cast<const c10::BFloat16*>(scales)[b]) : static_cast<const float*>(scales)[b];
  };
#pragma omp parallel for num_threads(std::max(1, at::get_num_threads())) schedule(dynamic, 4) if (n > (1 << 15))
  for (int64_t c = 0; c < nchunks; ++c) {
    alignas(64) float w[4096];
    alignas(64) float gbuf[4096];
    const int64_t i0 = c * C, len = std::min(C, n - i0);
    // a bf16 gradient widens exactly to fp32 (the reference's g.float()), chunk by chunk
    const float* gc = gbf ? gbuf : static_cast<const float*>(gv) + i0;
    if (gbf) widen_bf16(static_cast<const c10::BFloat16*>(gv) + i0, gbuf, len);
    for (int64_t o = 0; o < len; o += B) dequantize_block<F>(codes + i0 + o, scale_at((i0 + o) / B), w + o, std::min(B, len - o));
    if (states8) {
      auto* q1 = static_cast<uint8_t*>(s1) + i0;
      auto* q2 = static_cast<uint8_t*>(s2) + i0;
      for (int64_t o = 0; o < len; o += kOpt) {
        const int64_t b = (i0 + o) / kOpt;
        ppq::adam8::block_step(h, *m1, *m2, w + o, gc + o, q1 + o, q2 + o, a1 + b, a2 + b, std::min(kOpt, len - o));
      }
    } else {
      adamw_fp32(h, w, gc, static_cast<float*>(s1) + i0, static_cast<float*>(s2) + i0, len);
    }
    float sc[ppq::sr::kRun / 16];
    ppq::sr::quantize_blocks_t<F, false, false>(w, len, B, sbf, offset + uint64_t(i0), key, codes + i0, sc);
    ppq::sr::store_scales(scales, sbf, i0 / B, sc, (len + B - 1) / B);
  }
}

void master_free_adamw_step_(at::Tensor& codes, at::Tensor& scales, c10::string_view fmt, int64_t B,
                             const at::Tensor& g, at::Tensor& state1, at::Tensor& state2, at::Tensor& absmax1,
                             at::Tensor& absmax2, const at::Tensor& qmap1, const at::Tensor& qmap2, double beta1,
                             double beta2, double eps, int64_t step, double lr, double weight_decay,
                             double grad_scale, int64_t seed, int64_t offset) {
  const Fmt f = parse_fmt(fmt);
  TORCH_CHECK(B >= 16 && B <= 4096 && (B & (B - 1)) == 0, "block_size=", B,
              " is not allowed: use a power of two in [16, 4096]");
  const int64_t n = codes.numel();
  TORCH_CHECK(n > 0, "codes is empty");
  const int64_t nb = (n + B - 1) / B;
  check(codes, "codes", code_type(f), n);
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16, "scales has dtype ",
              scales.scalar_type(), "; allowed: Float or BFloat16");
  check(scales, "scales", scales.scalar_type(), nb);
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16, "g has dtype ",
              g.scalar_type(), "; allowed: Float or BFloat16 (a master-free layer's gradient buffer)");
  check(g, "g", g.scalar_type(), n);
  TORCH_CHECK(step >= 1, "step=", step, " must be >= 1");
  TORCH_CHECK(seed >= 0 && seed <= 0xffffffffLL, "seed=", seed, " is not allowed: use [0, 2^32)");
  TORCH_CHECK(offset >= 0, "offset=", offset, " is not allowed: use a non-negative counter");
  const bool states8 = state1.scalar_type() == at::kByte;
  TORCH_CHECK(states8 || state1.scalar_type() == at::kFloat, "state1 has dtype ", state1.scalar_type(),
              "; allowed: Float (fp32 moments) or Byte (8-bit states)");
  check(state1, "state1", state1.scalar_type(), n);
  check(state2, "state2", state1.scalar_type(), n);
  std::shared_ptr<const ppq::adam8::Map> map1, map2;  // held through the step (adam8bit.h's get_map)
  if (states8) {
    const int64_t na = (n + ppq::adam8::kBlock - 1) / ppq::adam8::kBlock;
    check(absmax1, "absmax1", at::kFloat, na);
    check(absmax2, "absmax2", at::kFloat, na);
    check(qmap1, "qmap1", at::kFloat, 256);
    check(qmap2, "qmap2", at::kFloat, 256);
    map1 = ppq::adam8::get_map(qmap1.data_ptr<float>());
    map2 = ppq::adam8::get_map(qmap2.data_ptr<float>());
  }
  const ppq::adam8::Map* m1 = map1.get();
  const ppq::adam8::Map* m2 = map2.get();
  const ppq::adam8::Hyper h = ppq::adam8::make_hyper(beta1, beta2, eps, step, lr, weight_decay, grad_scale);
  auto* cp = static_cast<uint8_t*>(codes.data_ptr());
  const bool sbf = scales.scalar_type() == at::kBFloat16;
  float* a1 = states8 ? absmax1.data_ptr<float>() : nullptr;
  float* a2 = states8 ? absmax2.data_ptr<float>() : nullptr;
  const uint32_t key = ppq::sr::hash32(static_cast<uint32_t>(seed));
  const uint64_t off = static_cast<uint64_t>(offset);
  void* sp = scales.data_ptr();
  void* s1 = state1.data_ptr();
  void* s2 = state2.data_ptr();
  const void* gp = g.data_ptr();
  const bool gbf = g.scalar_type() == at::kBFloat16;
  switch (f) {
    case Fmt::I8: run<Fmt::I8>(cp, sp, sbf, B, n, gp, gbf, s1, s2, a1, a2, m1, m2, h, key, off); break;
    case Fmt::E4M3: run<Fmt::E4M3>(cp, sp, sbf, B, n, gp, gbf, s1, s2, a1, a2, m1, m2, h, key, off); break;
    default: run<Fmt::E5M2>(cp, sp, sbf, B, n, gp, gbf, s1, s2, a1, a2, m1, m2, h, key, off); break;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ppq, CPU, m) { m.impl("master_free_adamw_step_", &master_free_adamw_step_); }
