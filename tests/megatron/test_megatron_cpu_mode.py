"""The launcher's CPU mode (megatron_patches.cpu_shim.enter_cpu_mode), in one process."""

from __future__ import annotations

import pytest
import torch

from megatron_patches import cpu_shim


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode is for machines without a GPU")
def test_cpu_mode_looks_like_one_cuda_device_and_is_undone():
    from megatron.core import tensor_parallel

    original_seed = tensor_parallel.model_parallel_cuda_manual_seed
    cpu_shim.enter_cpu_mode()
    try:
        assert cpu_shim.cpu_mode_active()
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        x = torch.ones(3)
        assert x.cuda() is x and x.to("cuda").device.type == "cpu"
        assert x.cuda().type() == "torch.cuda.FloatTensor"  # what megatron-core's optimizers check
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
        assert torch.cuda.max_memory_allocated() == 0
        assert not torch.accelerator.is_available()
        # megatron-core's seeding keeps CPU generator states under its tracker names
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            a = torch.rand(4)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            b = torch.rand(4)
        assert not torch.equal(a, b)  # the forked state advances
    finally:
        cpu_shim.exit_cpu_mode()
    assert not cpu_shim.cpu_mode_active()
    assert not torch.cuda.is_available()
    assert tensor_parallel.model_parallel_cuda_manual_seed is original_seed
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
