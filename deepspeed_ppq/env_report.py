"""The environment report behind ``ppq report`` (as DeepSpeed's ``ds_report``): versions, which kernels
are built for which device, and what the machine it runs on can use (a GPU, Transformer Engine,
bitsandbytes)."""

from __future__ import annotations

import importlib
import json
import platform

import torch

__all__ = ["collect_report", "format_report", "add_parser"]


def _version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
        return getattr(m, "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - a broken optional install must not break the report
        return f"not usable ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"


def _transformer_engine() -> str:
    try:
        import transformer_engine.pytorch as te  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:
        return f"not usable ({type(e).__name__})"
    ok, reason = te.is_fp8_available(return_reason=True)
    version = importlib.import_module("transformer_engine").__version__
    return f"{version}, fp8 {'yes' if ok else 'no: ' + reason}"


def collect_report() -> dict:
    """Everything ``ppq report`` prints, as a dict."""
    from deepspeed_ppq import __version__, ops

    mod = ops._CPU_MODULE.get("module")
    build = mod.build_info() if mod is not None else "not built"
    kernels = {}
    for name in sorted(ops.registered_ops()):
        devs = ["reference"]
        if ops.has_kernel(name, "cpu"):
            devs.append("cpu")
        if torch.version.cuda is not None and ops.has_kernel(name, "cuda"):
            devs.append("cuda")
        kernels[name] = devs
    return {
        "deepspeed_ppq": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "megatron-core": _version("megatron.core"),
        "bitsandbytes": _version("bitsandbytes"),
        "transformer_engine": _transformer_engine(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "native": ops.native_status(),
        "cpu_isa": f"{ops.cpu_isa()} (this CPU runs: {', '.join(ops.supported_cpu_isas())}; "
        "PPQ_CPU_ISA forces one)",
        "cpu_build": build,
        "kernels": kernels,
    }


def format_report(rep: dict) -> str:
    lines = ["deepspeed_ppq report", "-" * 60]
    for k, v in rep.items():
        if k in ("kernels", "native"):
            continue
        lines.append(f"{k:<20} {v}")
    for k, v in rep["native"].items():
        lines.append(f"{'extension ' + k:<20} {v}")
    lines.append("-" * 60)
    lines.append(f"{'op':<36} implementations")
    for name, devs in rep["kernels"].items():
        lines.append(f"ppq::{name:<31} {', '.join(devs)}")
    return "\n".join(lines)


def _report(args) -> int:
    rep = collect_report()
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0


def _load_all_ops() -> None:
    # Importing the op modules declares their ops so the report can list them.
    for mod in ("deepspeed_ppq.quant.ops", "deepspeed_ppq.compress.ops"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError:
            pass


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="versions, built kernels and usable devices")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=lambda a: (_load_all_ops(), _report(a))[1])
