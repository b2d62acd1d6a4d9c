// The Python module of the CUDA extension (deepspeed_ppq._C_cuda). The kernels register themselves with
// TORCH_LIBRARY_IMPL(ppq, CUDA, m) in their *_binding.cpp files when the shared object is loaded; this file
// only gives it the Python entry point (PyInit__C_cuda) that `import deepspeed_ppq._C_cuda` needs, and says
// how it was built. Plain CPython API, like csrc/cpu/module.cpp.
#include <Python.h>
#include <cuda_runtime_api.h>

#include <string>

#define PPQ_STR2(x) #x
#define PPQ_STR(x) PPQ_STR2(x)
#define PPQ_CAT2(a, b) a##b
#define PPQ_CAT(a, b) PPQ_CAT2(a, b)

namespace {

PyObject* build_info(PyObject*, PyObject*) {
  const std::string s = "cuda kernels: CUDA runtime headers " + std::to_string(CUDART_VERSION / 1000) + "." +
                        std::to_string(CUDART_VERSION % 1000 / 10);
  return PyUnicode_FromString(s.c_str());
}

PyMethodDef kMethods[] = {{"build_info", build_info, METH_NOARGS, "How the CUDA extension was compiled"},
                          {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, PPQ_STR(TORCH_EXTENSION_NAME), nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PPQ_CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&kModule); }
