"""Every csrc/**/*.cu compiles with nvcc for sm_80 and sm_90, wherever nvcc is present.

The kernels are plain CUDA C++ (raw pointers and a stream; no torch headers) so this check needs
no CUDA build of PyTorch: CUDA code never rots unseen on CPU-only CI.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CU_FILES = sorted((ROOT / "csrc").rglob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("cu", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cu_compiles(cu, tmp_path):
    cmd = [
        "nvcc", "-c", "-std=c++17", "-O2", f"-I{ROOT / 'csrc'}",
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        str(cu), "-o", str(tmp_path / (cu.stem + ".o")),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"


def test_there_are_cuda_kernels():
    assert CU_FILES, "csrc/ has no .cu files"
