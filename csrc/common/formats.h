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

// Bits per stored value.
PPQ_FMT_HD constexpr int bits(Fmt f) {
  switch (f) {
    case Fmt::I8: return 8;
    case Fmt::I4: return 4;
    case Fmt::NF4: return 4;
    case Fmt::E4M3: return 8;
    case Fmt::E5M2: return 8;
  }
  return 0;
}

// Q: the stored scale is absmax / Q; the largest magnitude a code stands for.
PPQ_FMT_HD constexpr float qmax(Fmt f) {
  switch (f) {
    case Fmt::I8: return 127.0f;
    case Fmt::I4: return 7.0f;
    case Fmt::NF4: return 1.0f;
    case Fmt::E4M3: return 448.0f;
    case Fmt::E5M2: return 57344.0f;
  }
  return 0.0f;
}

// Two 4-bit codes per byte, the first value in the high nibble.
PPQ_FMT_HD constexpr bool packed4(Fmt f) {
  switch (f) {
    case Fmt::I8: return false;
    case Fmt::I4: return true;
    case Fmt::NF4: return true;
    case Fmt::E4M3: return false;
    case Fmt::E5M2: return false;
  }
  return false;
}

// Codes are fp8 numbers.
PPQ_FMT_HD constexpr bool is_fp8(Fmt f) {
  switch (f) {
    case Fmt::I8: return false;
    case Fmt::I4: return false;
    case Fmt::NF4: return false;
    case Fmt::E4M3: return true;
    case Fmt::E5M2: return true;
  }
  return false;
}

// May keep one scale for the whole tensor instead of one per block.
PPQ_FMT_HD constexpr bool per_tensor_scale(Fmt f) {
  switch (f) {
    case Fmt::I8: return false;
    case Fmt::I4: return false;
    case Fmt::NF4: return false;
    case Fmt::E4M3: return true;
    case Fmt::E5M2: return true;
  }
  return false;
}

// Has a stochastic-rounding quantizer.
PPQ_FMT_HD constexpr bool has_sr(Fmt f) {
  switch (f) {
    case Fmt::I8: return true;
    case Fmt::I4: return false;
    case Fmt::NF4: return false;
    case Fmt::E4M3: return true;
    case Fmt::E5M2: return true;
  }
  return false;
}

// fp8: the largest finite code of magnitude at most qmax (0 for other formats).
PPQ_FMT_HD constexpr int max_code(Fmt f) {
  switch (f) {
    case Fmt::I8: return 0;
    case Fmt::I4: return 0;
    case Fmt::NF4: return 0;
    case Fmt::E4M3: return 126;
    case Fmt::E5M2: return 123;
  }
  return 0;
}

}  // namespace ppq::formats

// The codebook of nf4, in code order: initialise a table with `float t[16] = {PPQ_CODE_MAP_NF4};`.
#define PPQ_CODE_MAP_NF4 \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, \
  -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f, \
  0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, \
  0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f
