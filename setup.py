"""Build deepspeed_ppq and its native kernels.

    pip install --no-build-isolation -e .

* The C++ CPU extension (``deepspeed_ppq._C``, every ``csrc/cpu/*.cpp``) is always built.
* The CUDA extension (``deepspeed_ppq._C_cuda``: every ``csrc/cuda/*.cu`` plus the thin
  ``csrc/cuda/*_binding.cpp`` files) is built only where PyTorch has CUDA.
* ``PPQ_SKIP_NATIVE=1`` skips both; the package then runs on its plain-PyTorch reference kernels.
* ``PPQ_MARCH`` sets ``-march`` for the CPU build (default ``native``: the extension is built on
  the machine that runs it).

``--no-build-isolation`` matters: the build imports the installed torch to find its headers.
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _native_extensions():
    if os.environ.get("PPQ_SKIP_NATIVE", "0") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    march = os.environ.get("PPQ_MARCH", "native")
    cxx = ["-O3", "-fopenmp", "-std=c++20", f"-march={march}", "-ffp-contract=off", "-DPPQ_CPU"]
    cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp"))
    exts = [
        CppExtension(
            "deepspeed_ppq._C",
            cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    ]
    if torch.version.cuda is not None and os.environ.get("PPQ_SKIP_CUDA", "0") != "1":
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
        exts.append(
            CUDAExtension(
                "deepspeed_ppq._C_cuda",
                cuda_sources,
                include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={
                    "cxx": ["-O3", "-std=c++20"],
                    "nvcc": [
                        "-O3",
                        "-std=c++17",
                        "-gencode=arch=compute_80,code=sm_80",
                        "-gencode=arch=compute_90,code=sm_90",
                    ],
                },
            )
        )
    return exts, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _native_extensions()

setup(
    name="deepspeed_ppq",
    version="0.1.0",
    description="Pipeline parallelism and low-bit weights as one problem, for DeepSpeed and Megatron-core",
    packages=find_packages(include=["deepspeed_ppq", "deepspeed_ppq.*", "megatron_patches", "megatron_patches.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13", "pydantic>=2", "numpy", "scipy", "matplotlib", "tqdm"],
    extras_require={"deepspeed": ["deepspeed==0.19.8"], "megatron": ["megatron-core==0.16.1"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["ppq=deepspeed_ppq.cli:main"]},
)
