"""Runtime ISA dispatch of the C++ CPU kernels (csrc/README.md).

Every CPU path the build has is held to the plain-PyTorch references: the kernel test files run
again in a subprocess with ``PPQ_CPU_ISA`` forcing each path other than the one this process
loaded (which the files themselves test here). Paths this CPU lacks are skipped with the reason.
The scalar module must hold no AVX instruction, the AVX2 module no AVX-512 one and the AVX-512
module no VBMI one, so one build runs on every x86-64 CPU (checked on the disassembly where objdump exists).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_ppq import ops

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["quant/test_weight_kernels.py", "compress/test_codecs.py", "quant/test_adam8bit.py",
                "quant/test_master_free.py"]  # relative to tests/
SUPPORTED = ops.supported_cpu_isas()

needs_native = pytest.mark.skipif(
    ops.native_status().get("_C") != "loaded",
    reason=f"C++ extension not loaded ({ops.native_status().get('_C')})",
)


def _module_path(isa: str) -> Path | None:
    found = sorted((ROOT / "deepspeed_ppq").glob(f"_C_{isa}.*.so"))
    return found[0] if found else None


def _skip_unless_runnable(isa: str) -> None:
    """Skip, saying why, when this CPU lacks ``isa`` or its module was not built."""
    if isa not in SUPPORTED:
        pytest.skip(f"this CPU lacks {isa} (it runs {', '.join(SUPPORTED)})")
    if _module_path(isa) is None:
        pytest.skip(f"deepspeed_ppq._C_{isa} is not built (PPQ_CPU_ISAS / PPQ_MARCH build)")


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PPQ_CPU_ISA", "PPQ_FORCE_REFERENCE")}
    env.update(kw, DS_ACCELERATOR="cpu")
    return env


def test_default_is_the_widest_supported_path():
    assert SUPPORTED[-1] == "scalar" and set(SUPPORTED) <= set(ops.CPU_ISAS)
    if ops.native_status().get("_C") == "loaded" and not os.environ.get("PPQ_CPU_ISA"):
        built = [isa for isa in SUPPORTED if _module_path(isa) is not None]
        assert ops.cpu_isa() == (built[0] if built else ops.cpu_isa())


@pytest.mark.parametrize("value", ["sse9", "AVX2x", "neon"])
def test_unknown_isa_is_refused(value):
    code = "import deepspeed_ppq.ops"
    res = subprocess.run(
        [sys.executable, "-c", code], env=_env(PPQ_CPU_ISA=value), capture_output=True, text=True
    )
    assert res.returncode != 0
    allowed = "avx512vbmi, avx512, avx2, scalar"
    assert f"PPQ_CPU_ISA={value.lower()!r} is not a CPU kernel path; allowed: {allowed}" in res.stderr


@pytest.mark.parametrize("isa", [i for i in ops.CPU_ISAS if i not in SUPPORTED] or ["none"])
def test_missing_isa_is_refused(isa):
    if isa == "none":
        pytest.skip("this CPU runs every path")
    res = subprocess.run(
        [sys.executable, "-c", "import deepspeed_ppq.ops"],
        env=_env(PPQ_CPU_ISA=isa),
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and f"PPQ_CPU_ISA={isa!r}: this CPU cannot run that path" in res.stderr


@needs_native
@pytest.mark.parametrize("isa", ops.CPU_ISAS)
def test_forced_path_loads_and_reports(isa):
    _skip_unless_runnable(isa)
    code = (
        "import deepspeed_ppq.ops as o; from deepspeed_ppq.env_report import collect_report as c; "
        "print(o.cpu_isa(), c()['cpu_isa'])"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=_env(PPQ_CPU_ISA=isa), capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[:2] == [isa, isa], res.stdout


@needs_native
@pytest.mark.parametrize("isa", ops.CPU_ISAS)
def test_kernels_match_reference_on_every_path(isa):
    _skip_unless_runnable(isa)
    if isa == ops.cpu_isa():
        pytest.skip(f"{isa} is this process's path: the kernel test files test it in-process")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS]
    res = subprocess.run(cmd, cwd=ROOT / "tests", env=_env(PPQ_CPU_ISA=isa), capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert re.search(r"\d+ passed", res.stdout), res.stdout[-2000:]


_VEX = re.compile(r"^\s+[0-9a-f]+:\s+v[a-z0-9]+\s", re.M)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump is not installed")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_modules_hold_no_wider_instructions(isa):
    so = _module_path(isa)
    if so is None:
        pytest.skip(f"deepspeed_ppq._C_{isa} is not built")
    asm = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True
    ).stdout
    assert asm, f"objdump gave no disassembly of {so}"
    if isa == "scalar":
        bad = _VEX.findall(asm)
        assert not bad, f"{so.name} holds {len(bad)} AVX (VEX) instructions, e.g. {bad[:3]}"
    elif isa == "avx2":
        bad = re.findall(r".*%(?:zmm\d+|[xy]mm(?:1[6-9]|2\d|3[01])|k[1-7])\b.*", asm)
        assert not bad, f"{so.name} holds {len(bad)} AVX-512 instructions, e.g. {bad[:3]}"
    else:  # VBMI's byte permutes and multishift
        bad = re.findall(r"^\s+[0-9a-f]+:\s+(?:vpermb|vpermi2b|vpermt2b|vpmultishiftqb)\s.*", asm, re.M)
        assert not bad, f"{so.name} holds {len(bad)} VBMI instructions, e.g. {bad[:3]}"
