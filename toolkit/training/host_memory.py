"""Host memory that a training process gives back when it frees it.

glibc's malloc serves large requests with their own memory mapping, returned to the system on
free, but only above a threshold that it raises at run time (up to 32 MiB on 64-bit) each time a
mapped block is freed. Training frees blocks of a few MiB to tens of MiB at every step (FSDP's
gathered weights and unsharded gradients, activations), so after the first step they are carved
out of the heap instead, where freed memory stays part of the process. Measured with
`benchmarks/whole_run_peak.py` (pythia-160m, 32-true, sequence 128): the largest process peaked at
3,269 MiB on 2 processes and 2,891 MiB on 4, against 3,404 on one; with the threshold fixed at
1 MiB, 2,283 and 1,679 MiB, which is the live tensor bytes of the step (`toolkit estimate
--simulate true`) plus the process's fixed overhead. Tensors above 32 MiB were never affected,
so large models change little; small ones, and every process's peak on CPU, do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt's parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD). Setting it also
# switches off the threshold's dynamic adjustment.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def return_large_frees_to_the_system(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process; True if it was set.

    A no-op (False) where the C library is not glibc (macOS, musl) or has no mallopt."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, threshold) == 1  # mallopt returns 1 on success
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) was refused; host memory freed during training may stay with the process")
    return done
