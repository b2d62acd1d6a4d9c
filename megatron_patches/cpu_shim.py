"""Run megatron-core's pipeline schedules on CPU with gloo (tests and CPU-only development).

megatron-core assumes CUDA in three places that a CPU run reaches (read in 0.16.1):

- ``schedules.py`` allocates ``total_num_tokens = torch.zeros([], ..., device="cuda")``;
- ``P2PCommunicator._communicate`` / ``_communicate_shapes`` allocate on ``torch.cuda.current_device()``;
- ``_communicate`` calls ``torch.cuda.synchronize()`` when ``batch_p2p_comm`` and ``batch_p2p_sync``.

:func:`cpu_shim` rewrites ``device="cuda..."`` keyword arguments to ``"cpu"`` through a
``TorchFunctionMode`` and replaces ``torch.cuda.current_device``/``synchronize`` for its duration.
It is a test and development aid: production runs on GPUs never enter it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shim"]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare ordinal means a CUDA device to torch.empty & co


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Inside this context, megatron-core's hard-coded CUDA allocations land on the CPU.

    Does nothing when CUDA is available. Not re-entrant across threads (it patches ``torch.cuda``).
    """
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved
