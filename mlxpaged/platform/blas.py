"""Load the system OpenBLAS before MLX on Linux.

The `mlx[cpu]` wheel links a reference BLAS (a 2048x2048 float32 matmul takes ~3.4 s
here). libmlx leaves `cblas_sgemm` undefined, so a BLAS loaded earlier with
RTLD_GLOBAL wins symbol resolution (~0.15 s). That only works before `mlx.core`
is imported; afterwards we can only warn.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ENV_OVERRIDE = "MLXPAGED_BLAS"  # a library path, or "off" to keep MLX's own BLAS
HINT = "install the system OpenBLAS for ~20x faster CPU matmuls: apt-get install libopenblas0-pthread"

THREAD_TIMEOUT = "4"  # OPENBLAS_THREAD_TIMEOUT: log2 of the cycles a helper spins before it sleeps (4 = least)

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasStatus:
    name: str  # "openblas", "accelerate", "mlx-bundled", "mlx-bundled (openblas loaded too late)"
    path: str | None
    detail: str

    @property
    def fast(self) -> bool:
        return self.name in ("openblas", "accelerate")


_status: BlasStatus | None = None


def avx512_core(cpuinfo: str) -> str | None:
    """OPENBLAS_CORETYPE for an AMD CPU with AVX-512 (Zen 4 and later), else None (OpenBLAS decides).

    OpenBLAS 0.3.21 (Debian 12) does not know Zen 4 and runs its Haswell (AVX2) kernels there; its
    SkylakeX kernels need only the AVX-512 subsets checked here. Measured on this machine (AMD EPYC,
    SmolLM2-135M's 30 layers of matmuls): one token 18.6 -> 11.4 ms, 8 tokens 38.5 -> 27.7 ms,
    64 tokens 74.8 -> 48.7 ms; batch-1 decode 24.9 -> 28.5 tok/s. Intel CPUs are left to OpenBLAS,
    which knows theirs (forcing SkylakeX could downgrade a newer core)."""
    flags: set[str] = set()
    vendor = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    if vendor == "AuthenticAMD" and {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    return None


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def find_openblas() -> str | None:
    """Path of the system OpenBLAS, or None when it is not installed."""
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    return ctypes.util.find_library("openblas")


def load_fast_blas() -> BlasStatus:
    """Load OpenBLAS globally if we are on Linux and mlx is not imported yet. Idempotent."""
    global _status
    if _status is not None:
        return _status
    if sys.platform == "darwin":
        _status = BlasStatus("accelerate", None, "MLX uses Apple Accelerate / Metal")
        return _status
    override = os.environ.get(ENV_OVERRIDE, "")
    if override.lower() == "off":
        _status = BlasStatus("mlx-bundled", None, f"{ENV_OVERRIDE}=off")
        return _status
    path = override or find_openblas()
    if path is None:
        _status = BlasStatus("mlx-bundled", None, HINT)
        return _status
    if "mlx.core" in sys.modules:
        warnings.warn(
            f"mlx was imported before mlxpaged, so OpenBLAS cannot take over; import mlxpaged first ({path})",
            RuntimeWarning,
            stacklevel=3,
        )
        _status = BlasStatus("mlx-bundled (openblas loaded too late)", path, "import mlxpaged before mlx")
        return _status
    # OpenBLAS reads this once, when it loads. By default its helper threads spin for ~2^28 cycles
    # after each call; the spinning helper kept a core from the NumPy attention workers that run right
    # after a layer's matmuls (kernels/numpy_attention.py): a 16k cache hit took 0.19-0.30 s, with it
    # at 4 (sleep at once) 0.196-0.235 s; decode and 16-request batches measured the same either way.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    core = avx512_core(_read_cpuinfo()) if not override else None  # a library the user chose is theirs to tune
    if core is not None:
        os.environ.setdefault("OPENBLAS_CORETYPE", core)
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        _status = BlasStatus("mlx-bundled", None, f"could not load {path}: {exc}")
        return _status
    chosen = f", OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}" if os.environ.get("OPENBLAS_CORETYPE") else ""
    _status = BlasStatus("openblas", path, f"loaded with RTLD_GLOBAL before mlx{chosen}")
    return _status


def blas_status() -> BlasStatus:
    return load_fast_blas()


def openblas_core() -> str | None:
    """The kernel family the loaded OpenBLAS runs ("Haswell", "SkylakeX", ...), None without OpenBLAS. Its float
    rounding is the family's (issue 41: Haswell's sgemm rounds a row by how many rows share the call), so bug
    reports name it (`mlxpaged doctor`)."""
    status = load_fast_blas()
    if status.name != "openblas" or status.path is None:
        return None
    try:
        name = ctypes.CDLL(status.path).openblas_get_corename
    except (OSError, AttributeError):
        return None
    name.restype = ctypes.c_char_p
    core = name()
    return core.decode() if core else None
