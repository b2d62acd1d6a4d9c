"""megatron_patches on every supported megatron-core version (megatron_patches.compat).

The project's environment pins megatron-core 0.16.1 (requirements.txt) and every megatron test runs
on it in ``make test``. The newest release, 0.19.2, needs Python >= 3.12 (0.17.0 onwards declare
``Requires-Python >=3.12``), so it cannot share this Python 3.11 environment; it installs with the
same torch 2.13.0 on Python 3.12. This test runs the megatron test files (2 gloo ranks: compressed P2P
inside megatron-core's schedules, low-bit layers, the optimizer patch, the launcher, the flags) under
an interpreter that has the other version:

- ``PPQ_MCORE_PYTHON=/path/to/python``: an environment with torch 2.13.0 and a supported
  megatron-core (plus the test dependencies, see ``_PACKAGES``);
- ``PPQ_MCORE_BUILD=1``: builds one under ``$PPQ_MCORE_VENV`` (default: the temp dir) from
  ``$PPQ_PYTHON312`` or a ``python3.12`` on PATH, and PyPI (a few GB: torch's CUDA build is PyPI's
  only Linux wheel for 3.12).

Skipped, saying which, when neither is given, no Python 3.12 is found or PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_patches import compat

ROOT = Path(__file__).resolve().parents[2]
NEWEST = "0.19.2"
MEGATRON_TESTS = [f"tests/megatron/test_megatron_{name}.py"
                  for name in ("args", "cpu_mode", "p2p", "layers", "optim", "run")]
# What the megatron tests import besides torch and megatron-core, at this project's pins.
_PACKAGES = ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions",
             "einops", "packaging", "hypothesis", "sortedcontainers", "pytest", "pytest-timeout", "iniconfig",
             "pluggy", "psutil", "bitsandbytes")


def _pins() -> list[str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        pins[line.partition("==")[0].strip().lower()] = line.strip()
    return [pins.get(p.lower(), p) for p in _PACKAGES]


def _build_venv() -> str:
    py312 = os.environ.get("PPQ_PYTHON312") or shutil.which("python3.12")
    if py312 is None or subprocess.run([py312, "-c", "import venv"], capture_output=True).returncode:
        pytest.skip(f"PPQ_MCORE_BUILD=1 but no usable python3.12 on PATH (or PPQ_PYTHON312): megatron-core "
                    f"{NEWEST} needs Python >= 3.12")
    venv = Path(os.environ.get("PPQ_MCORE_VENV", Path(tempfile.gettempdir()) / f"ppq-mcore-{NEWEST}-py312"))
    python = venv / "bin" / "python"
    stamp = venv / ".ppq-ready"
    if not stamp.exists():
        subprocess.run([py312, "-m", "venv", str(venv)], check=True)
        pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0",
                              f"megatron-core=={NEWEST}", *_pins()], capture_output=True, text=True)
        if pip.returncode != 0:
            pytest.skip(f"could not install megatron-core {NEWEST} with torch 2.13.0 from the registry "
                        f"(unreachable?): {pip.stderr.strip().splitlines()[-1:]}")
        stamp.touch()
    return str(python)


def _interpreter() -> str:
    if os.environ.get("PPQ_MCORE_PYTHON"):
        return os.environ["PPQ_MCORE_PYTHON"]
    if os.environ.get("PPQ_MCORE_BUILD") == "1":
        return _build_venv()
    pytest.skip(f"megatron-core {NEWEST} needs Python >= 3.12 (this environment: {sys.version.split()[0]}, "
                f"megatron-core {compat.megatron_version()}): set PPQ_MCORE_PYTHON to a Python with torch "
                f"2.13.0 and megatron-core {NEWEST}, or PPQ_MCORE_BUILD=1 to build one from PyPI")


@pytest.mark.slow
@pytest.mark.distributed
def test_megatron_tests_pass_on_the_other_supported_version():
    python = _interpreter()
    code = ("import json, sys, torch; from megatron.core import package_info as p; "
            "print(json.dumps([p.__version__, torch.__version__, sys.version.split()[0]]))")
    probe = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    mcore, torch_version, py = json.loads(probe.stdout.strip().splitlines()[-1])
    assert mcore in compat.TESTED_MEGATRON_VERSIONS and mcore != compat.megatron_version(), (mcore, python)
    assert torch_version.split("+")[0] == "2.13.0", torch_version
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    env.pop(compat.ALLOW_UNTESTED_ENV, None)
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MEGATRON_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-3000:]
    print(f"megatron-core {mcore}, torch {torch_version}, Python {py}:\n{tail}")
    assert run.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail
