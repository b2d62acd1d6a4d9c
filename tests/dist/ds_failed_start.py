"""Rank script: a start that fails after ``deepspeed.init_distributed`` and before ``initialize``."""

import json
import os
import sys

import deepspeed

import deepspeed_ppq.integrations.deepspeed  # noqa: F401 - importing it registers the shm clean-up
from deepspeed_ppq.integrations.shm import deepspeed_shm_paths

deepspeed.init_distributed(dist_backend="gloo")
deepspeed.comm.barrier()
with open(os.path.join(os.environ["PPQ_TEST_OUT"], f"buffers{os.environ['RANK']}.json"), "w") as f:
    json.dump([str(p) for p in deepspeed_shm_paths(ranks=[os.environ["RANK"]])], f)
deepspeed.comm.barrier()
sys.exit("failed start: a bad argument found after init_distributed")
