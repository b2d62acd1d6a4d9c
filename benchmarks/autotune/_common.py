"""Shared bits of the autotune benchmarks: the machine record and result files."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent.parent / "results"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "loadavg": os.getloadavg()[0],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write(name: str, data: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(f"wrote {RESULTS / name}.json and .md")
