// fp32 <-> fp8 (e4m3fn, e5m2) bit conversions shared by the CPU kernels (weights.cpp, weights_sr.cpp,
// codecs.cpp).
//
// Design note.
// * Encode is c10's own recipe (fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value, the conversion
//   torch's .to(float8) uses), bit for bit, rewritten with integer masks instead of branches: written
//   this way GCC vectorises a loop over it (AVX-512 at -O3 -march=native); c10's scalar form with its
//   if/else chain stays a scalar loop (codecs.cpp's fp8_encode ran at 0.5x copy bandwidth with it).
//   - subnormal results: add a magic float whose exponent puts the fp8 subnormal ulp at bit 0, so the
//     FPU's round-to-nearest-even does the rounding, then subtract the magic's bits;
//   - normal results: rebias the exponent, add half an ulp minus one plus the odd bit (ties to even),
//     shift the fp8 bits down.
//   Callers clamp to the finite range (|x| <= 448 / 57344) first; NaN is the one input that may reach
//   the saturating branch and becomes 0x7f with its sign bit, as in c10. (For e4m3fn, values in
//   (464, 480) would round to code 0x7f, c10's NaN; we saturate to 0x7e. Clamped inputs never get there.)
// * Decode is arithmetic on the bits (no table, no branch): normal = exponent rebias, subnormal =
//   mantissa * 2^-k, then the special codes (e4m3fn: NaN only; e5m2: Inf and NaN; NaN is the quiet
//   0x7fc00000 with the code's sign). The same values as c10's fp8 -> fp32 (c10's NaN has another payload).
// * `sel` is an integer-mask select: GCC keeps `c ? a : b` on these as branches in some loops, which
//   stops vectorisation ("control flow in loop"); masks do not.
// Header-only and inline so each kernel's loop inlines it; the tests compare every code and value with
// torch's own casts (tests/quant/test_weight_kernels.py, tests/compress/test_codecs.py, tests/quant/test_master_free.py).
#pragma once

#include <bit>
#include <cstdint>

namespace ppq::fp8 {

inline uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

// c ? a : b with masks.
inline uint32_t sel(bool c, uint32_t a, uint32_t b) {
  uint32_t m = 0u - uint32_t(c);
  return (a & m) | (b & ~m);
}

// fp32 -> e4m3fn bits (round to nearest even; input clamped to [-448, 448] or NaN).
inline uint8_t f32_to_e4m3(float f) {
  uint32_t u = bits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  constexpr uint32_t dm = 141u << 23;  // magic 2^14: fp8 subnormal ulp 2^-9 lands on bit 0
  uint32_t r_dn = bits(from_bits(u) + from_bits(dm)) - dm;
  uint32_t r_n = (u + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
  uint32_t r = sel(u < (121u << 23), r_dn, r_n);  // below 2^-6: subnormal
  r = sel(r == 0x7fu, 0x7eu, r);
  r = sel(u > 0x7f800000u, 0x7fu, r);
  return uint8_t(r | (sign >> 24));
}

// fp32 -> e5m2 bits (round to nearest even; input clamped to [-57344, 57344] or NaN).
inline uint8_t f32_to_e5m2(float f) {
  uint32_t u = bits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  constexpr uint32_t dm = 134u << 23;  // magic 2^7: fp8 subnormal ulp 2^-16 lands on bit 0
  uint32_t r_dn = bits(from_bits(u) + from_bits(dm)) - dm;
  uint32_t r_n = (u + ((uint32_t)(15 - 127) << 23) + 0xfffffu + ((u >> 21) & 1u)) >> 21;
  uint32_t r = sel(u < (113u << 23), r_dn, r_n);  // below 2^-14: subnormal
  r = sel(u > 0x7f800000u, 0x7fu, r);
  return uint8_t(r | (sign >> 24));
}

// e4m3fn bits -> fp32.
inline float e4m3_to_f32(uint8_t c) {
  uint32_t u = c & 0x7fu;
  uint32_t nb = (u << 20) + (120u << 23);
  uint32_t sb = bits(float(int32_t(u)) * 0x1p-9f);
  uint32_t r = sel(u >= 8u, nb, sb);
  r = sel(u == 0x7fu, 0x7fc00000u, r);
  return from_bits(r | (uint32_t(c & 0x80u) << 24));
}

// e5m2 bits -> fp32.
inline float e5m2_to_f32(uint8_t c) {
  uint32_t u = c & 0x7fu;
  uint32_t nb = (u << 21) + (112u << 23);
  uint32_t sb = bits(float(int32_t(u)) * 0x1p-16f);
  uint32_t r = sel(u >= 4u, nb, sb);
  r = sel(u >= 0x7cu, 0x7f800000u | (uint32_t(u > 0x7cu) << 22), r);  // 0x7c: Inf; above: NaN
  return from_bits(r | (uint32_t(c & 0x80u) << 24));
}

}  // namespace ppq::fp8
