"""Peak throughput and bandwidth of the devices the roofline cost model knows, each with its source.

``achievable`` is the fraction of peak that well-tuned training kernels reach in practice (dense
matmuls for ``flops``, streaming kernels for ``mem``); these are planning figures, replace them with
a measured profile when one exists.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hardware", "HARDWARE", "get_hardware"]


@dataclass(frozen=True)
class Hardware:
    """One device: peak dense FLOP/s per dtype, memory bandwidth and capacity, link bandwidth."""

    name: str
    flops: dict          # dtype -> peak dense FLOP/s
    mem_bw: float        # bytes/s
    mem_bytes: int
    link_bw: float       # bytes/s per direction to the next pipeline stage
    link_latency: float  # seconds
    achievable_flops: float
    achievable_mem: float
    source: str

    def matmul_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ValueError(f"dtype={dtype!r} has no peak on {self.name}: use one of "
                             f"{', '.join(self.flops)}")
        return self.flops[dtype] * self.achievable_flops


_T = 1e12
HARDWARE = {
    "h100": Hardware(
        "NVIDIA H100 SXM5 80GB", {"fp32": 67 * _T, "tf32": 495 * _T, "bf16": 989 * _T, "fp16": 989 * _T,
                                  "fp8": 1979 * _T, "int8": 1979 * _T},
        3.35e12, 80 << 30, 450e9, 5e-6, 0.6, 0.8,
        "NVIDIA H100 Tensor Core GPU datasheet (dense, without sparsity); NVLink 4: 900 GB/s total, "
        "450 GB/s per direction"),
    "h200": Hardware(
        "NVIDIA H200 SXM 141GB", {"fp32": 67 * _T, "tf32": 495 * _T, "bf16": 989 * _T, "fp16": 989 * _T,
                                  "fp8": 1979 * _T, "int8": 1979 * _T},
        4.8e12, 141 << 30, 450e9, 5e-6, 0.6, 0.8,
        "NVIDIA H200 Tensor Core GPU datasheet (dense); same compute as H100, HBM3e 4.8 TB/s"),
    "a100": Hardware(
        "NVIDIA A100 SXM4 80GB", {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T,
                                  "int8": 624 * _T},
        2.039e12, 80 << 30, 300e9, 5e-6, 0.6, 0.8,
        "NVIDIA A100 Tensor Core GPU datasheet (dense); NVLink 3: 600 GB/s total, 300 GB/s per direction"),
    "cpu": Hardware(
        "2-vCPU Xeon VM (AVX-512, AMX), 1 thread per rank",
        # AVX-512 FMA: 2 units x 16 fp32 x 2 FLOP x ~2.5 GHz = 160 GFLOP/s per core peak; bf16 via AMX higher.
        {"fp32": 160e9, "bf16": 320e9},
        10e9, 24 << 30, 5e9, 5e-5, 0.35, 0.8,
        "memory: one core streams ~10 GB/s (a large-array copy timed on a 2-vCPU Xeon VM); AVX-512 FMA "
        "peak; achievable fraction from eager matmuls on one thread; "
        "link: gloo over loopback as measured by benchmarks/sim/validate_runtime.py"),
}


def get_hardware(name: str) -> Hardware:
    """Look up a device by key (``h100``, ``h200``, ``a100``, ``cpu``).

    Raises:
        ValueError: naming the unknown key and the known ones.
    """
    key = name.lower()
    if key not in HARDWARE:
        raise ValueError(f"hardware={name!r} is unknown: use one of {', '.join(HARDWARE)}")
    return HARDWARE[key]
