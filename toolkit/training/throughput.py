"""Peak FLOP/s of the device, for model-FLOPs utilization (MFU) in the training log.

GPUs: dense (no sparsity) peaks from the vendors' data sheets. CPUs have no data sheet figure we can
trust, so the peak is either given by the user (--log.device_peak_flops) or measured at start-up
with a matrix product in the training precision. An unknown GPU gets no MFU rather than a guess.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

# name fragment (lower case) -> {dtype: dense FLOP/s}
GPU_PEAK_FLOPS = {
    "h200": {"bf16": 989e12, "fp32": 67e12},
    "h100 sxm": {"bf16": 989e12, "fp32": 67e12},
    "h100 nvl": {"bf16": 835e12, "fp32": 60e12},
    "h100 pcie": {"bf16": 756e12, "fp32": 51e12},
    "h100": {"bf16": 989e12, "fp32": 67e12},
    "gh200": {"bf16": 989e12, "fp32": 67e12},
    "b200": {"bf16": 2250e12, "fp32": 80e12},
    "a100": {"bf16": 312e12, "fp32": 19.5e12},
    "a10g": {"bf16": 70e12, "fp32": 31.2e12},
    "a6000": {"bf16": 155e12, "fp32": 38.7e12},
    "l40s": {"bf16": 362e12, "fp32": 91.6e12},
    "l4": {"bf16": 121e12, "fp32": 30.3e12},
    "v100": {"bf16": 125e12, "fp32": 15.7e12},  # fp16 tensor cores; no bf16 on V100
    "4090": {"bf16": 165e12, "fp32": 82.6e12},
    "3090": {"bf16": 71e12, "fp32": 35.6e12},
}


def precision_kind(precision: str) -> str:
    return "bf16" if ("bf16" in precision or precision.startswith("16")) else "fp32"


def gpu_peak_flops(device_name: str, precision: str) -> Optional[float]:
    name = device_name.lower()
    for fragment, peaks in GPU_PEAK_FLOPS.items():
        if fragment in name:
            return peaks[precision_kind(precision)]
    return None


class CpuPeak:
    """This CPU's matrix-product rate for MFU, measured at start-up and measured again, briefly, at
    the first REFRESHES log steps (`refresh`), the fastest product winning: a start-up measurement
    that overlapped with other work (a data loader's workers starting) read as low as half."""

    REFRESHES = 10

    def __init__(self, dtype: torch.dtype, size: int = 1024, seconds: float = 0.25) -> None:
        generator = torch.Generator().manual_seed(0)  # private: the training RNG stream is left untouched
        self.a = torch.randn(size, size, generator=generator).to(dtype)
        self.b = torch.randn(size, size, generator=generator).to(dtype)
        self.a @ self.b  # warm-up
        self.fastest, self.refreshes = math.inf, 0
        self._time(seconds)

    @property
    def flops(self) -> float:
        return 2 * self.a.shape[0] ** 3 / max(self.fastest, 1e-9)

    def _time(self, seconds: float) -> None:
        start = time.perf_counter()
        while True:
            before = time.perf_counter()
            self.a @ self.b
            after = time.perf_counter()
            self.fastest = min(self.fastest, after - before)
            if after - start >= seconds:
                return

    def refresh(self) -> float:
        """The rate after timing a few more products (about 10 ms), at the first REFRESHES calls."""
        if self.refreshes < self.REFRESHES:
            self.refreshes += 1
            self._time(0.01)
        return self.flops


def device_peak_flops(device: torch.device, precision_plugin, user_peak: Optional[float]) -> "Optional[float | CpuPeak]":
    """Peak FLOP/s of one device for MFU: the user's figure, a GPU's from the table, or a CPU's
    measured (a `CpuPeak`, which the loop refreshes); None where unknown."""
    if user_peak:
        return user_peak
    precision = str(getattr(precision_plugin, "precision", "32-true"))
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        dtype = torch.bfloat16 if precision_kind(precision) == "bf16" else torch.float32
        return CpuPeak(dtype)
    return None
