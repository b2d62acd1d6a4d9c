import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# importable by every test: tests/ (dist_utils, fake_slurm) and examples/ (stdlib_text, the examples' text)
sys.path[:0] = [str(TESTS), str(TESTS.parent / "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of PyTorch (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
