"""Kernel registry: one ``torch.library`` op per kernel, in the ``ppq::`` namespace.

Every op is declared once here (``define_op``) with
  * its schema,
  * a fake (meta) kernel, so ``torch.compile`` and ``opcheck`` can trace it,
  * a plain-PyTorch reference, registered as the ``CompositeExplicitAutograd`` default, so every
    device works even with no native build.
The C++ extension (``deepspeed_ppq._C``, ``csrc/cpu``) registers ``CPU`` kernels for the same names
and the CUDA extension (``deepspeed_ppq._C_cuda``, ``csrc/cuda``) registers ``CUDA`` kernels; the
dispatcher prefers a backend kernel over the composite default.

Loading the extensions: tried once at import; if one is missing we warn once with the reason and
fall back to the references. ``PPQ_FORCE_REFERENCE=1`` skips loading them.

Ops are forward primitives; autograd lives one layer up (``torch.autograd.Function`` wrappers).
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable

import torch

__all__ = [
    "define_op",
    "native_status",
    "require_native",
    "has_kernel",
    "registered_ops",
]

_LIB = torch.library.Library("ppq", "DEF")
_REFERENCES: dict[str, Callable] = {}
_NATIVE: dict[str, str] = {}  # extension name -> "loaded" or the reason it is not


def define_op(schema: str, reference: Callable, fake: Callable):
    """Declare ``ppq::<name>`` from ``schema`` with its reference and fake kernels.

    Args:
        schema: e.g. ``"quantize_int8(Tensor x, int block_size) -> (Tensor, Tensor)"``.
        reference: plain-PyTorch implementation; the default on every device.
        fake: shape/dtype-only implementation for tracing.

    Returns:
        The op, ``torch.ops.ppq.<name>``.
    """
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema)
    _LIB.impl(name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ppq::{name}", lib=_LIB)(fake)
    _REFERENCES[name] = reference
    return getattr(torch.ops.ppq, name)


def registered_ops() -> dict[str, Callable]:
    """Every declared op name mapped to its plain-PyTorch reference."""
    return dict(_REFERENCES)


def has_kernel(name: str, device: str = "cpu") -> bool:
    """Whether a native kernel (not the reference) serves ``ppq::name`` on ``device``."""
    key = {"cpu": "CPU", "cuda": "CUDA"}[device]
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"ppq::{name}", key)


def _load(ext: str) -> None:
    if os.environ.get("PPQ_FORCE_REFERENCE", "0") == "1":
        _NATIVE[ext] = "skipped: PPQ_FORCE_REFERENCE=1"
        return
    try:
        importlib.import_module(f"deepspeed_ppq.{ext}")
        _NATIVE[ext] = "loaded"
    except ImportError as e:
        _NATIVE[ext] = f"not available: {e}"


def _load_native() -> None:
    _load("_C")
    if _NATIVE["_C"] != "loaded" and not _NATIVE["_C"].startswith("skipped"):
        warnings.warn(
            f"deepspeed_ppq: C++ kernels {_NATIVE['_C']}; using the plain-PyTorch reference kernels "
            "(build them with `pip install --no-build-isolation -e .` or `make build`)",
            stacklevel=2,
        )
    if torch.version.cuda is not None:
        _load("_C_cuda")
    else:
        _NATIVE["_C_cuda"] = "not built: this PyTorch has no CUDA"


def native_status() -> dict[str, str]:
    """``{"_C": "loaded" | reason, "_C_cuda": ...}`` for ``ppq report``."""
    return dict(_NATIVE)


def require_native() -> None:
    """Raise unless the C++ CPU extension is loaded (used by ``make build``)."""
    if _NATIVE.get("_C") != "loaded":
        raise RuntimeError(f"deepspeed_ppq._C: {_NATIVE.get('_C')}")


_load_native()
