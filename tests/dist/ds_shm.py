"""Rank script: DeepSpeed's CPU backend creates a /dev/shm all-reduce buffer per rank; report its path."""

import os

import deepspeed
from dist_utils import write_result

from deepspeed_ppq.integrations.shm import deepspeed_shm_paths, release_at_exit

deepspeed.init_distributed(dist_backend="gloo")
release_at_exit()
mine = deepspeed_shm_paths(ranks=[os.environ["RANK"]])
deepspeed.comm.barrier()
write_result({"port": os.environ["MASTER_PORT"], "buffers": [str(p) for p in mine]})
