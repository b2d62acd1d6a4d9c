"""Run megatron-core, and Megatron-LM's own training scripts, on CPU with gloo.

Two levels:

- :func:`cpu_shim` (a context manager around a schedule call, for tests of megatron-core's pipeline
  schedules). megatron-core assumes CUDA in a few places that a CPU run reaches (read in 0.16.1):
  ``schedules.py`` allocates ``total_num_tokens`` with ``device="cuda"``; ``P2PCommunicator`` allocates
  on ``torch.cuda.current_device()`` and calls ``torch.cuda.synchronize()`` when ``batch_p2p_comm`` and
  ``batch_p2p_sync``; the optimizers accept only parameters whose ``tensor.type()`` is
  ``"torch.cuda.{Float,Half,BFloat16}Tensor"``. The shim rewrites ``device="cuda..."`` keyword
  arguments to ``"cpu"`` through a ``TorchFunctionMode``, answers ``tensor.type()`` of a CPU floating
  tensor with the CUDA type name, and replaces ``torch.cuda.current_device``/``synchronize`` and the
  stream functions (megatron-core 0.19's DDP grad sync asks for ``torch.cuda.current_stream()``).
- :func:`enter_cpu_mode` (what ``python -m megatron_patches.run --cpu`` does for a whole script).
  Megatron-LM's ``megatron/training`` asserts ``torch.cuda.is_available()``, skips model-parallel
  set-up when ``torch.cuda.device_count()`` is 0, moves modules with ``Tensor.cuda()``, builds a DDP
  stream with ``torch.cuda.Stream``/``stream``/``current_stream``, compiles fused kernels with nvcc
  (``megatron.legacy.fused_kernels.load``), seeds CUDA generators
  (``tensor_parallel.model_parallel_cuda_manual_seed``) and reports CUDA memory. CPU mode answers all
  of these for the process: CUDA reported available with one device that is the CPU, every
  ``cuda`` device argument (keyword or ``.to(...)``/``.cuda()``) landing on the CPU, streams and
  events that do nothing, memory statistics of 0, the RNG tracker on CPU generators, and
  ``torch.compile``'d fusions run eagerly.

Both are development aids: a run on GPUs never enters them (the launcher only patches there).

:func:`seed_cpu_rng_tracker` stands in for ``model_parallel_cuda_manual_seed``: megatron-core's RNG
tracker (forked around dropout and weight init) keeps CUDA generator states; on CPU it keeps CPU
generator states under the same names and seeds.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shim", "seed_cpu_rng_tracker", "enter_cpu_mode", "exit_cpu_mode", "cpu_mode_active"]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare ordinal means CUDA


_CPU_FLOAT_TYPES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor")


class _CudaToCpu(TorchFunctionMode):
    """``device="cuda..."`` -> ``"cpu"``; ``tensor.type()`` of CPU floats reads as CUDA.

    With ``moves=True`` (CPU mode) also ``Tensor.cuda()`` and ``Tensor.to("cuda"...)`` stay on the CPU.
    """

    def __init__(self, moves: bool = False):
        super().__init__()
        self.moves = moves

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name in _CPU_FLOAT_TYPES else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if self.moves:
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Inside this context, megatron-core's hard-coded CUDA allocations land on the CPU.

    Does nothing when CUDA is available (or CPU mode already covers the process). Not re-entrant
    across threads (it patches ``torch.cuda``).
    """
    if torch.cuda.is_available():
        yield
        return
    saved = {name: getattr(torch.cuda, name) for name in _SHIM_CUDA}
    for name in _SHIM_CUDA:
        setattr(torch.cuda, name, _TORCH_CUDA[name])
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def seed_cpu_rng_tracker(seed: int, *_ignored, **_kw) -> None:
    """Seed torch and register megatron-core's tracked RNG states on the CPU generator.

    A drop-in for ``tensor_parallel.model_parallel_cuda_manual_seed(seed, ...)`` (the TE/inference/
    cudagraph tracker options have no CPU meaning and are ignored): the data-parallel state gets
    ``seed``, the model-parallel one ``seed + 2718 + tp_rank`` and, where megatron-core has it, the
    expert-parallel one ``seed + 1024 + 100 * ep_rank + etp_rank``, as there.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tp_rank = ep_rank = etp_rank = 0
    if ps.model_parallel_is_initialized():
        tp_rank = ps.get_tensor_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
        etp_rank = ps.get_expert_tensor_parallel_rank()

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
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    expert = getattr(mrandom, "_EXPERT_PARALLEL_RNG_TRACKER_NAME", None)
    if expert is not None:
        tracker.add(expert, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


# -- CPU mode: a whole Megatron-LM script on the CPU ---------------------------------------------------


class _Stream:
    """``torch.cuda.Stream``/``Event`` on the CPU: everything is already ordered, nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _Stream()

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def elapsed_time(self, *a) -> float:
        return 0.0


class _Event(_Stream):
    """``torch.cuda.Event`` on the CPU."""


def _returning(value):
    """A fresh function returning ``value`` (one object per patched name: torch._dynamo's trace rules
    refuse one function object registered under two names with different rules)."""
    def fn(*a, **k):
        return value() if callable(value) else value
    return fn


# torch.cuda attributes replaced in CPU mode (read in Megatron-LM core_v0.16.1 and core_v0.19.0).
_TORCH_CUDA = {
    "is_available": _returning(True),
    "device_count": _returning(1),
    "current_device": _returning("cpu"),
    "set_device": _returning(None),
    "synchronize": _returning(None),
    "Stream": _Stream,
    "Event": _Event,
    "stream": _returning(contextlib.nullcontext),
    "current_stream": _returning(_Stream),
    "default_stream": _returning(_Stream),
    "set_stream": _returning(None),
    "empty_cache": _returning(None),
    "memory_allocated": _returning(0),
    "max_memory_allocated": _returning(0),
    "memory_reserved": _returning(0),
    "max_memory_reserved": _returning(0),
    "reset_peak_memory_stats": _returning(None),
    "reset_max_memory_allocated": _returning(None),
    "memory_stats": _returning(dict),
    "get_device_capability": _returning((0, 0)),
    "get_device_name": _returning("cpu (megatron_patches CPU mode)"),
    "get_rng_state": _returning(lambda: torch.empty(0, dtype=torch.uint8)),
    "set_rng_state": _returning(None),
    "get_rng_state_all": _returning(list),
    "set_rng_state_all": _returning(None),
    "manual_seed": _returning(None),
    "manual_seed_all": _returning(None),
    "is_current_stream_capturing": _returning(False),
}

# torch.accelerator tells the truth: no accelerator (a CUDA build of PyTorch would name CUDA there and
# then torch.optim asks CUDA for the stream, the DataLoader pins memory on it).
_TORCH_ACCELERATOR = {
    "is_available": _returning(False),
    "current_accelerator": _returning(None),
    "current_stream": _returning(_Stream),
    "synchronize": _returning(None),
}

# What cpu_shim() replaces for a schedule call (0.19 also asks DDP's grad sync for the current stream).
_SHIM_CUDA = ("current_device", "synchronize", "current_stream", "stream", "Stream", "Event")

# Megatron functions replaced in CPU mode: (module, attribute) -> replacement. A module that is not
# importable (megatron.legacy exists only in a Megatron-LM checkout) is skipped.
_MEGATRON = {
    ("megatron.core.tensor_parallel", "model_parallel_cuda_manual_seed"): seed_cpu_rng_tracker,
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"): seed_cpu_rng_tracker,
    ("megatron.legacy.fused_kernels", "load"): _returning(None),
}

_SAVED: dict = {}


def cpu_mode_active() -> bool:
    """Whether :func:`enter_cpu_mode` is in effect in this process."""
    return bool(_SAVED)


def enter_cpu_mode() -> None:
    """Make this process look to Megatron-LM like one CUDA device that is the CPU (see module doc).

    Call before the script imports ``megatron.training``; undone by :func:`exit_cpu_mode`.
    Idempotent.
    """
    if _SAVED:
        return
    from .compat import check_megatron_version

    check_megatron_version("CPU mode")
    for mod_name, table in (("torch.cuda", _TORCH_CUDA), ("torch.accelerator", _TORCH_ACCELERATOR)):
        mod = importlib.import_module(mod_name)
        for name, value in table.items():
            if hasattr(mod, name):
                _SAVED[(mod_name, name)] = getattr(mod, name)
                setattr(mod, name, value)
    for (mod_name, attr), value in _MEGATRON.items():
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(mod, attr):
            _SAVED[(mod_name, attr)] = getattr(mod, attr)
            setattr(mod, attr, value)
    # megatron-core wraps its fusions in torch.compile (megatron.core.jit); on the CPU they run eagerly:
    # inductor would spend minutes compiling them on a few cores.
    dynamo_config = importlib.import_module("torch._dynamo.config")
    _SAVED[("torch._dynamo.config", "disable")] = dynamo_config.disable
    dynamo_config.disable = True
    mode = _CudaToCpu(moves=True)
    mode.__enter__()
    _SAVED["mode"] = mode


def exit_cpu_mode() -> None:
    """Undo :func:`enter_cpu_mode`."""
    mode = _SAVED.pop("mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
    for (mod_name, attr), value in _SAVED.items():
        mod = importlib.import_module(mod_name)
        setattr(mod, attr, value)
    _SAVED.clear()
