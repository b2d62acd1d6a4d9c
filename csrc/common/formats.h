// Low-bit weight formats for the C++ CPU kernels and the CUDA kernels: one row per format.
// Generated from deepspeed_ppq/formats.py (the table) by
//   python -m deepspeed_ppq.formats > csrc/common/formats.h
// Do not edit by hand: tests/test_format_table.py checks this file against the table.
// Plain C++17 with no torch header, so nvcc compiles it; the helpers run on host and device.
#pragma once

#include <string_view>

#if defined(__CUDACC__)
#define PPQ_FMT_HD __host__ __device__
#else
#define PPQ_FMT_HD
#endif

namespace ppq::formats {

// The integer code of each format: what the kernels switch on and the CUDA entry points take.
enum class Fmt : int { I8 = 0, I4 = 1, NF4 = 2, E4M3 = 3, E5M2 = 4 };

inline constexpr int kNumFormats = 5;

// Names, in code order, and the lists error messages offer.
inline constexpr std::string_view kNames[kNumFormats] = {"int8", "int4", "nf4", "fp8_e4m3", "fp8_e5m2"};
inline constexpr const char* kAllowed = "int8, int4, nf4, fp8_e4m3 or fp8_e5m2";
inline constexpr const char* kAllowedSR = "int8, fp8_e4m3 or fp8_e5m2";

// The format called `name`, or false (and `out` untouched) when no format has that name.
inline bool parse(std::string_view name, Fmt* out) {
  for (int i = 0; i < kNumFormats; ++i) {
    if (kNames[i] == name) {
      *out = static_cast<Fmt>(i);
      return true;
    }
  }
  return false;
}

// One row per format, as the table's.
struct Row {
  int bits;  // bits per stored value
  float qmax;  // Q: the stored scale is absmax / Q; the largest magnitude of a code
  bool packed4;  // two 4-bit codes per byte, the first in the high nibble
  bool is_fp8;  // codes are fp8 numbers
  bool per_tensor_scale;  // may keep one scale for the whole tensor
  bool has_sr;  // has a stochastic-rounding quantizer
  int max_code;  // fp8: the largest finite code <= qmax (0 otherwise)
};

PPQ_FMT_HD constexpr Row row(Fmt f) {
  switch (f) {
    case Fmt::I8: return {8, 127.0f, false, false, false, true, 0};
    case Fmt::I4: return {4, 7.0f, true, false, false, false, 0};
    case Fmt::NF4: return {4, 1.0f, true, false, false, false, 0};
    case Fmt::E4M3: return {8, 448.0f, false, true, true, true, 126};
    case Fmt::E5M2: return {8, 57344.0f, false, true, true, true, 123};
  }
  return {};
}

PPQ_FMT_HD constexpr int bits(Fmt f) { return row(f).bits; }
PPQ_FMT_HD constexpr float qmax(Fmt f) { return row(f).qmax; }
PPQ_FMT_HD constexpr bool packed4(Fmt f) { return row(f).packed4; }
PPQ_FMT_HD constexpr bool is_fp8(Fmt f) { return row(f).is_fp8; }
PPQ_FMT_HD constexpr bool per_tensor_scale(Fmt f) { return row(f).per_tensor_scale; }
PPQ_FMT_HD constexpr bool has_sr(Fmt f) { return row(f).has_sr; }
PPQ_FMT_HD constexpr int max_code(Fmt f) { return row(f).max_code; }

}  // namespace ppq::formats

// The codebook of nf4, in code order: initialise a table with `float t[16] = {PPQ_CODE_MAP_NF4};`.
#define PPQ_CODE_MAP_NF4 \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, \
  -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f, \
  0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, \
  0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f
