"""Keep glibc from returning MLX's large CPU temporaries to the OS after every op.

On the CPU backend each model step allocates and frees tens of megabytes of
temporaries. glibc serves blocks above its (dynamic) mmap threshold with fresh
mmaps and unmaps them on free, so the next step page-faults them in again:
measured on the 2-core host, a fused exp over a 28 MB array took 114 ms with
glibc's defaults and 25 ms once large blocks came from the heap. This is what
`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` do from the environment;
`mallopt` does it at run time. An explicit environment setting wins; on macOS
(Metal buffers, no glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Largest block still served by mmap, and free heap kept before trimming: 1 GiB each, so
# step temporaries are reused while a freed KV pool (larger) still goes back to the OS.
_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True when applied."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): leave the allocator alone
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim): after a model is unloaded, what
    keep_freed_memory() lets the heap keep for reuse would otherwise stay in the process's resident set.
    True when glibc trimmed anything; on macOS (no glibc) it does nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.malloc_trim(0))
