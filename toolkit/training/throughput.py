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


def measure_cpu_flops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.25) -> float:
    """FLOP/s of a square matrix product on this CPU with the current thread count: the fastest of
    the products timed one by one for `seconds`, so that a moment of load from another process
    (which made a mean over the window half the machine's rate, and MFU above 100%) is left out."""
    generator = torch.Generator().manual_seed(0)  # private: the training RNG stream is left untouched
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    a @ b  # warm-up
    fastest, start = math.inf, time.perf_counter()
    while True:
        before = time.perf_counter()
        a @ b
        after = time.perf_counter()
        fastest = min(fastest, after - before)
        if after - start >= seconds:
            return 2 * size**3 / max(fastest, 1e-9)


def device_peak_flops(device: torch.device, precision_plugin, user_peak: Optional[float]) -> Optional[float]:
    if user_peak:
        return user_peak
    precision = str(getattr(precision_plugin, "precision", "32-true"))
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        dtype = torch.bfloat16 if precision_kind(precision) == "bf16" else torch.float32
        return measure_cpu_flops(dtype)
    return None
