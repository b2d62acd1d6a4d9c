"""Kernel registry: one ``torch.library`` op per kernel, in the ``ppq::`` namespace.

Every op is declared once here (``define_op``) with
  * its schema,
  * a fake (meta) kernel, so ``torch.compile`` and ``opcheck`` can trace it,
  * a plain-PyTorch reference, registered as the ``CompositeExplicitAutograd`` default, so every
    device works even with no native build.
The C++ extension (``csrc/cpu``) registers ``CPU`` kernels for the same names and the CUDA extension
(``deepspeed_ppq._C_cuda``, ``csrc/cuda``) registers ``CUDA`` kernels; the dispatcher prefers a
backend kernel over the composite default.

CPU instruction sets: the C++ kernels are built once per path (``deepspeed_ppq._C_scalar``,
``_C_avx2``, ``_C_avx512``, ``_C_avx512vbmi``; see csrc/README.md) and exactly one is imported, at
load time: the widest this CPU runs, or the one ``PPQ_CPU_ISA=scalar|avx2|avx512|avx512vbmi`` forces
(an unknown value, or a path the CPU lacks, raises naming it). ``cpu_isa()`` says which path is in
use. A module with instructions the CPU lacks is never imported, so one build runs on every x86-64 CPU.

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
    "cpu_isa",
    "supported_cpu_isas",
    "CPU_ISAS",
]

CPU_ISAS = ("avx512vbmi", "avx512", "avx2", "scalar")  # widest first
# /proc/cpuinfo flags each compiled path needs (setup.py: -march=x86-64-v4 -mavx512vbmi / x86-64-v4 /
# x86-64-v3 / x86-64).
_ISA_CPU_FLAGS = {
    "avx2": ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe"),
    "scalar": (),
}
_ISA_CPU_FLAGS["avx512"] = _ISA_CPU_FLAGS["avx2"] + (
    "avx512f",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512vl",
)
_ISA_CPU_FLAGS["avx512vbmi"] = _ISA_CPU_FLAGS["avx512"] + ("avx512vbmi",)

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


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def supported_cpu_isas() -> list[str]:
    """The CPU kernel paths this CPU can run, widest first (``"scalar"`` always)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["scalar"]
    flags = _cpu_flags()
    if flags is None:  # no /proc/cpuinfo: ask PyTorch's own detection
        cap = torch.backends.cpu.get_cpu_capability().upper()
        return {"AVX512": ["avx512", "avx2", "scalar"], "AVX2": ["avx2", "scalar"]}.get(cap, ["scalar"])
    return [isa for isa in CPU_ISAS if flags.issuperset(_ISA_CPU_FLAGS[isa])]


def _pick_cpu_isa() -> list[str]:
    """The variant modules to try, in order: the forced one, or every supported one, widest first."""
    forced = os.environ.get("PPQ_CPU_ISA", "").strip().lower()
    supported = supported_cpu_isas()
    if not forced:
        return supported
    if forced not in CPU_ISAS:
        raise ValueError(f"PPQ_CPU_ISA={forced!r} is not a CPU kernel path; allowed: {', '.join(CPU_ISAS)}")
    if forced not in supported:
        flags = _cpu_flags() or set()
        missing = [f for f in _ISA_CPU_FLAGS[forced] if f not in flags]
        raise RuntimeError(
            f"PPQ_CPU_ISA={forced!r}: this CPU cannot run that path (missing {' '.join(missing) or 'it'}); "
            f"allowed here: {', '.join(supported)}"
        )
    return [forced]


_CPU_MODULE: dict[str, object] = {}


def cpu_isa() -> str:
    """The instruction-set path of the C++ CPU kernels in use: ``"avx512vbmi"``, ``"avx512"``, ``"avx2"``,
    ``"scalar"``, or ``"reference"`` when no C++ CPU module is loaded (plain-PyTorch kernels)."""
    mod = _CPU_MODULE.get("module")
    return mod.isa() if mod is not None else "reference"


def _load_cpu() -> None:
    """Import exactly one CPU variant module (importing registers its kernels)."""
    if os.environ.get("PPQ_FORCE_REFERENCE", "0") == "1":
        _NATIVE["_C"] = "skipped: PPQ_FORCE_REFERENCE=1"
        return
    import importlib.util

    candidates = _pick_cpu_isa()
    forced = bool(os.environ.get("PPQ_CPU_ISA", "").strip())
    tried = []
    for isa in [*candidates, "native"]:
        name = f"deepspeed_ppq._C_{isa}"
        if importlib.util.find_spec(name) is None:
            tried.append(f"{name} not built")
            continue
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            _NATIVE["_C"] = f"not available: {name}: {e}"
            return
        if isa == "native" and forced and mod.isa() != candidates[0]:
            raise RuntimeError(
                f"PPQ_CPU_ISA={candidates[0]!r}: this build has only a PPQ_MARCH module, "
                f"compiled for {mod.isa()!r}"
            )
        _CPU_MODULE["module"] = mod
        _NATIVE["_C"] = "loaded"
        return
    _NATIVE["_C"] = "not available: " + "; ".join(tried)


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
    _load_cpu()
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
