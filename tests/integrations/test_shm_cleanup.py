"""DeepSpeed 0.19.8's CPU backend leaves a ~66 MiB /dev/shm buffer per rank after every run; ours go."""

import pytest
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.integrations.shm import deepspeed_shm_paths


@pytest.mark.distributed
def test_deepspeed_shm_buffers_are_released():
    r0, r1 = run_ranks(ROOT / "tests" / "dist" / "ds_shm.py", 2)
    if not r0["buffers"]:
        pytest.skip("this DeepSpeed build created no shm all-reduce buffer")
    assert r0["port"] == r1["port"] and len(r1["buffers"]) == 1
    assert deepspeed_shm_paths(r0["port"], "127.0.0.1") == []
