// The Python module of the C++ CPU extension. Kernels register themselves with
// TORCH_LIBRARY_IMPL(ppq, CPU, m) in their own files; this file only gives the shared object a
// Python entry point and reports how it was built (for `ppq report`).
#include <torch/extension.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static std::string build_info() {
  std::string s = "cpu";
#ifdef _OPENMP
  s += " openmp(max_threads=" + std::to_string(omp_get_max_threads()) + ")";
#endif
#ifdef __AVX512F__
  s += " avx512f";
#endif
#ifdef __AVX512BF16__
  s += " avx512bf16";
#endif
#ifdef __AVX2__
  s += " avx2";
#endif
  return s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_info", &build_info, "How the C++ CPU extension was compiled");
}
