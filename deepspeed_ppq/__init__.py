"""deepspeed_ppq: pipeline parallelism and low-bit weights planned as one problem.

Public entry points are imported lazily so ``import deepspeed_ppq`` stays cheap and works without
DeepSpeed or megatron-core installed.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "initialize", "autotune", "load_ppq_config", "PPQConfig"]


def __getattr__(name: str):
    if name == "initialize":
        from deepspeed_ppq.integrations.deepspeed import initialize

        return initialize
    if name == "autotune":  # the package, callable: deepspeed_ppq.autotune(model, loss_fn, ...)
        import deepspeed_ppq.autotune as tuner

        return tuner
    if name in ("load_ppq_config", "PPQConfig"):
        from deepspeed_ppq import config

        return getattr(config, name)
    raise AttributeError(f"module 'deepspeed_ppq' has no attribute {name!r}")
