"""Run megatron-core's pipeline schedules on CPU with gloo (tests and CPU-only development).

megatron-core assumes CUDA in three places that a CPU run reaches (read in 0.16.1):

- ``schedules.py`` allocates ``total_num_tokens = torch.zeros([], ..., device="cuda")``;
- ``P2PCommunicator._communicate`` / ``_communicate_shapes`` allocate on ``torch.cuda.current_device()``;
- ``_communicate`` calls ``torch.cuda.synchronize()`` when ``batch_p2p_comm`` and ``batch_p2p_sync``;
- the optimizers (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``, ``clip_grads``)
  accept only parameters whose ``tensor.type()`` is ``"torch.cuda.{Float,Half,BFloat16}Tensor"``.

:func:`cpu_shim` rewrites ``device="cuda..."`` keyword arguments to ``"cpu"`` through a
``TorchFunctionMode``, answers ``tensor.type()`` (no arguments) of a CPU floating tensor with the
CUDA type name, and replaces ``torch.cuda.current_device``/``synchronize`` for its duration.
It is a test and development aid: production runs on GPUs never enter it.

:func:`seed_cpu_rng_tracker` stands in for ``model_parallel_cuda_manual_seed``: megatron-core's
RNG tracker (forked around dropout and weight init) keeps CUDA generator states; on CPU it keeps
CPU generator states under the same names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shim", "seed_cpu_rng_tracker"]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare ordinal means a CUDA device to torch.empty & co


_CPU_FLOAT_TYPES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor")


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name in _CPU_FLOAT_TYPES else name
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


def seed_cpu_rng_tracker(seed: int) -> None:
    """Seed torch and register megatron-core's tracked RNG states on the CPU generator.

    Mirrors ``tensor_parallel.model_parallel_cuda_manual_seed`` for TP=1 (the model-parallel and
    data-parallel states get ``seed + 2718`` and ``seed``, as there).
    """
    from megatron.core.tensor_parallel import random as mrandom

    class _CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_ or name in self.states_:
                raise RuntimeError(f"rng state {name} / seed {seed} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    torch.manual_seed(seed)
    tracker = _CpuRNGStatesTracker()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
