// The Python module of one CPU variant of the C++ extension (deepspeed_ppq._C_scalar, _C_avx2,
// _C_avx512, _C_avx512vbmi or _C_native; see isa.h and setup.py). Kernels register themselves with
// TORCH_LIBRARY_IMPL(ppq, CPU, m) in their own files when the module is loaded; this file only gives
// the shared object a Python entry point that says which path it was compiled for (for
// deepspeed_ppq.ops.cpu_isa() and `ppq report`). Plain CPython API: no pybind11 or torch headers, so
// the three variants build quickly.
#include <Python.h>

#include <string>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "isa.h"

#define PPQ_STR2(x) #x
#define PPQ_STR(x) PPQ_STR2(x)
#define PPQ_CAT2(a, b) a##b
#define PPQ_CAT(a, b) PPQ_CAT2(a, b)

namespace {

PyObject* isa(PyObject*, PyObject*) { return PyUnicode_FromString(PPQ_ISA_NAME); }

PyObject* build_info(PyObject*, PyObject*) {
  std::string s = std::string("cpu ") + PPQ_ISA_NAME + " path:";
#ifdef _OPENMP
  s += " openmp(max_threads=" + std::to_string(omp_get_max_threads()) + ")";
#endif
#ifdef __AVX512F__
  s += " avx512f";
#endif
#ifdef __AVX512VBMI__
  s += " avx512vbmi";
#endif
#ifdef __AVX512BF16__
  s += " avx512bf16";
#endif
#ifdef __AVX2__
  s += " avx2";
#endif
#ifdef __FMA__
  s += " fma";
#endif
  return PyUnicode_FromString(s.c_str());
}

PyMethodDef kMethods[] = {
    {"isa", isa, METH_NOARGS, "The instruction-set path these kernels were compiled for"},
    {"build_info", build_info, METH_NOARGS, "How the C++ CPU extension was compiled"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, PPQ_STR(TORCH_EXTENSION_NAME), nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PPQ_CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&kModule); }
