"""The CUDA extension builds as far as a machine without a CUDA build of PyTorch allows, wherever nvcc is.

* Every ``csrc/**/*.cu`` compiles with nvcc for sm_80 and sm_90. The kernels are plain CUDA C++ (raw
  pointers and a stream; no torch headers), so this needs nothing but the CUDA toolkit.
* Every ``csrc/cuda/*.cpp`` (the ``*_binding.cpp`` files and ``module.cpp``) compiles with the host compiler
  against the installed torch's headers and the toolkit's, as setup.py's CUDAExtension compiles them. A
  CPU-only torch wheel lacks exactly one header those files need: ``c10/cuda/impl/cuda_cmake_macros.h``,
  which CMake generates only for a CUDA build of PyTorch (for a shared-library build it holds
  ``#define C10_CUDA_BUILD_SHARED_LIBS`` and nothing the bindings use). The test writes that one line into a
  header of its own temporary include directory; every other header is the installed torch's. (The
  bindings include ``c10/cuda/CUDAStream.h`` / ``CUDAGuard.h``, not ``ATen/cuda/CUDAContext.h``, which also
  needs the cuBLAS/cuSPARSE/cuSOLVER headers that a bare toolkit does not ship.)
* All objects link into one shared library against the CPU torch (libc10, libtorch_cpu) and the toolkit's
  libcudart with ``--no-undefined``: the only symbols left unresolved must be CPython's (the interpreter
  provides them at import) and ``c10::cuda::*`` (libc10_cuda, which only a CUDA build of PyTorch ships:
  the current stream, the device guard, the caching allocator). So a binding that calls a kernel entry point
  with another signature than the .cu file defines fails here, not at import on a GPU machine.
* Every ``ppq::`` op with a C++ CPU kernel also has a CUDA binding.

What cannot run here: loading the library and the kernels themselves (tests/ops/test_cuda_kernels.py, marked
``gpu``, does that on a machine with a GPU and a CUDA build of PyTorch).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CU_FILES = sorted((ROOT / "csrc").rglob("*.cu"))
CPP_FILES = sorted((ROOT / "csrc" / "cuda").glob("*.cpp"))
ARCHS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
# ops with a C++ CPU kernel and, on purpose, no CUDA kernel yet (on CUDA they run the reference): name -> why
CPU_ONLY = {
    "master_free_adamw_step_": "fused master-free AdamW step, new; its CUDA kernel is still to be written",
}
# Written into <tmp>/c10/cuda/impl/cuda_cmake_macros.h; see the module docstring.
CMAKE_MACROS_SHIM = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


def _toolkit_dirs() -> tuple[list[str], list[str]]:
    """The toolkit's include and library directories, as nvcc itself reports them (``--dryrun``)."""
    out = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    inc = re.findall(r'-I"?([^"\s]+)', "".join(re.findall(r"INCLUDES=(.*)", out)))
    lib = re.findall(r'-L"?([^"\s]+)', "".join(re.findall(r"LIBRARIES=(.*)", out)))
    return inc, [d for d in lib if not d.rstrip("/").endswith("stubs")]


def _compile_all(jobs: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(subprocess.run, cmd, capture_output=True, text=True)
                   for name, cmd in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda_build")


@pytest.fixture(scope="module")
def cu_objects(build_dir):
    """Each .cu compiled once (in parallel): name -> (process, object path)."""
    jobs, objs = {}, {}
    for cu in CU_FILES:
        obj = build_dir / f"{cu.stem}.cu.o"
        jobs[cu.name] = [NVCC, "-c", "-std=c++17", "-O2", "-Xcompiler", "-fPIC", f"-I{ROOT / 'csrc'}", *ARCHS,
                         str(cu), "-o", str(obj)]
        objs[cu.name] = obj
    done = _compile_all(jobs)
    return {name: (done[name], objs[name], jobs[name]) for name in jobs}


@pytest.fixture(scope="module")
def cpp_objects(build_dir):
    """Each csrc/cuda/*.cpp compiled once with the host compiler: name -> (process, object path)."""
    shim = build_dir / "shim"
    (shim / "c10" / "cuda" / "impl").mkdir(parents=True, exist_ok=True)
    (shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(CMAKE_MACROS_SHIM)
    from torch.utils.cpp_extension import include_paths

    toolkit_inc, _ = _toolkit_dirs()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-std=c++20", "-O1", "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H",
             "-DTORCH_EXTENSION_NAME=_C_cuda", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             *[f"-I{p}" for p in include_paths()], f"-I{shim}", *[f"-I{p}" for p in toolkit_inc],
             f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT / 'csrc'}"]
    cxx = os.environ.get("CXX", "c++")
    jobs, objs = {}, {}
    for src in CPP_FILES:
        obj = build_dir / f"{src.stem}.o"
        jobs[src.name] = [cxx, *flags, "-c", str(src), "-o", str(obj)]
        objs[src.name] = obj
    done = _compile_all(jobs)
    return {name: (done[name], objs[name], jobs[name]) for name in jobs}


def _assert_ok(entry):
    res, _, cmd = entry
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"


@needs_nvcc
@pytest.mark.parametrize("cu", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cu_compiles(cu, cu_objects):
    _assert_ok(cu_objects[cu.name])


@needs_nvcc
@pytest.mark.slow  # ~8 s of CPU per file: torch's headers and its op-registration templates
@pytest.mark.parametrize("src", CPP_FILES, ids=[p.name for p in CPP_FILES])
def test_binding_compiles(src, cpp_objects):
    _assert_ok(cpp_objects[src.name])


@needs_nvcc
@pytest.mark.slow
def test_extension_links_but_for_cpython_and_c10_cuda(cu_objects, cpp_objects, build_dir):
    """Link every object with --no-undefined: only CPython's and libc10_cuda's symbols may stay open."""
    objs = []
    for entry in [*cu_objects.values(), *cpp_objects.values()]:
        _assert_ok(entry)
        objs.append(str(entry[1]))
    _, toolkit_lib = _toolkit_dirs()
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [os.environ.get("CXX", "c++"), "-shared", "-o", str(build_dir / "_C_cuda.so"), *objs,
           f"-L{torch_lib}", "-lc10", "-ltorch_cpu", *[f"-L{d}" for d in toolkit_lib], "-lcudart",
           "-Wl,--no-undefined"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    missing = set(re.findall(r"undefined reference to `([^']+)'", res.stderr))
    assert res.returncode == 0 or missing, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"
    bad = sorted(s for s in missing if not (s.startswith("Py") or s.startswith("_Py") or "c10::cuda::" in s))
    assert not bad, "symbols no library provides (a binding/kernel signature mismatch?):\n" + "\n".join(bad)


def test_every_cpu_kernel_has_a_cuda_binding():
    """GPU completeness: an op with a C++ CPU kernel has a CUDA one too, or is listed in CPU_ONLY."""
    import deepspeed_ppq.compress.ops  # noqa: F401  (declare the ops)
    import deepspeed_ppq.quant.adam8bit  # noqa: F401
    import deepspeed_ppq.quant.ops  # noqa: F401
    import deepspeed_ppq.quant.sr_ops  # noqa: F401
    from deepspeed_ppq.ops import has_kernel, registered_ops

    with_cpu = {name for name in registered_ops() if has_kernel(name, "cpu")}
    if not with_cpu:
        pytest.skip("the C++ CPU extension is not built (make build)")
    bound = set()
    for src in CPP_FILES:
        text = src.read_text()
        if "TORCH_LIBRARY_IMPL(ppq, CUDA" in text:
            bound |= set(re.findall(r'm\.impl\("(\w+)"', text))
    missing = sorted(with_cpu - bound - set(CPU_ONLY))
    assert not missing, (f"ops with a CPU kernel but no CUDA binding: {missing}; write one (csrc/README.md, "
                         "'How to add a CUDA kernel') or list the op in CPU_ONLY with the reason")
    stale = sorted(set(CPU_ONLY) & bound)
    assert not stale, f"{stale} now have a CUDA binding: remove them from CPU_ONLY"


def test_there_are_cuda_kernels():
    assert CU_FILES, "csrc/ has no .cu files"
    assert (ROOT / "csrc" / "cuda" / "module.cpp").exists(), "_C_cuda needs its PyInit (module.cpp)"
