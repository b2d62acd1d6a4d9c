// The weight-format table (formats.h) where torch is at hand: an op's `fmt` argument parsed with the error
// every kernel gives, and the dtype of each format's codes. Shared by the CPU kernels (csrc/cpu) and the
// CUDA bindings (csrc/cuda/*_binding.cpp); lean c10 headers only.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <string>
#include <string_view>

#include "common/formats.h"

namespace ppq::formats {

// The format an op's `fmt` argument names; otherwise an error naming the value and the allowed names.
inline Fmt parse_or_throw(std::string_view name) {
  Fmt out = Fmt::I8;
  TORCH_CHECK(parse(name, &out), "fmt='", std::string(name), "' is not a weight format: use ", kAllowed);
  return out;
}

// The same for an op that re-quantizes with stochastic rounding: only formats with has_sr. `what` is what
// the others lack ("stochastic-rounding quantizer", "master-free update").
inline Fmt parse_sr_or_throw(std::string_view name, const char* what) {
  Fmt out = Fmt::I8;
  TORCH_CHECK(parse(name, &out) && has_sr(out), "fmt='", std::string(name), "' has no ", what, ": use ",
              kAllowedSR);
  return out;
}

// The dtype of a format's code tensor (the table's code_dtype; tests/test_format_table.py checks the two).
inline c10::ScalarType code_type(Fmt f) {
  switch (f) {
    case Fmt::I8: return c10::kChar;
    case Fmt::I4:
    case Fmt::NF4: return c10::kByte;
    case Fmt::E4M3: return c10::kFloat8_e4m3fn;
    case Fmt::E5M2: return c10::kFloat8_e5m2;
  }
  return c10::kByte;
}

}  // namespace ppq::formats
