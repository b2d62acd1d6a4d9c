"""The tests mirror the package: ``tests/<part>/test_*.py`` for ``deepspeed_ppq/<part>/`` (``quant``,
``compress``, ``schedule``, ``autotune``, ``integrations``: the DeepSpeed engine, ``models``), ``config``
(the ``"ppq"`` section and ``configs/``), ``cli``, ``ops`` (loading the native kernels per instruction
set, the CUDA build), ``megatron`` (``megatron_patches``) and ``e2e`` (the examples, the demo, the quality
study). At the top: what spans the package (its import floors, the format table, the memory categories).

Beside them: ``dist/`` and ``mcore/`` hold the rank scripts the distributed tests run by path, ``golden/``
the golden schedules and checkpoints, ``fake_slurm/`` and ``deepspeed_unit/`` test harnesses, and
``dist_utils.py`` starts ranks. Test file names are unique across folders (pytest imports each by name).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# importable by every test: tests/ (dist_utils, fake_slurm), the rank scripts of tests/dist/ (their models and
# settings) and examples/ (stdlib_text, the examples' text)
sys.path[:0] = [str(TESTS), str(TESTS / "dist"), str(TESTS.parent / "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of PyTorch (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Torch computes on one intra-op thread for the test (tiny matmuls: a second OpenMP thread costs more
    than it computes, and waits for a core when they are all busy)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
